use super::*;

fn spec(paths: &[&str]) -> Arc<UsageSpec> {
    let fields = paths.iter().map(|p| JsonPath::parse(p).unwrap()).collect();
    Arc::new(UsageSpec::new(fields).unwrap())
}

fn meter_in_chunks(spec: &Arc<UsageSpec>, content_type: &str, body: &[u8], chunk: usize) -> Result<u64, UsageProblem> {
    let mut meter = UsageMeter::new(spec.clone(), Some(content_type));
    for piece in body.chunks(chunk.max(1)) {
        meter.feed(piece);
    }
    meter.finish()
}

fn meter_whole(spec: &Arc<UsageSpec>, content_type: &str, body: &[u8]) -> Result<u64, UsageProblem> {
    meter_in_chunks(spec, content_type, body, body.len())
}

/// Every split of `body` into two frames gives `expected`.
fn assert_every_split(spec: &Arc<UsageSpec>, content_type: &str, body: &[u8], expected: Result<u64, UsageProblem>) {
    for at in 0..=body.len() {
        let mut meter = UsageMeter::new(spec.clone(), Some(content_type));
        meter.feed(&body[..at]);
        meter.feed(&body[at..]);
        assert_eq!(meter.finish(), expected, "split at {at}");
    }
}

const OPENAI_BODY: &str = r#"{
      "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
      "object": "chat.completion",
      "created": 1741570283,
      "model": "gpt-4o-2024-08-06",
      "choices": [
        {
          "index": 0,
          "message": {"role": "assistant", "content": "The image shows a wooden boardwalk… \"usage\": 1", "refusal": null},
          "logprobs": null,
          "finish_reason": "stop"
        }
      ],
      "usage": {
        "prompt_tokens": 1117,
        "completion_tokens": 46,
        "total_tokens": 1163,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}
      },
      "service_tier": "default",
      "system_fingerprint": "fp_fc9f1d7035"
    }"#;

#[test]
fn openai_json_body_sums_prompt_and_completion_tokens() {
    let spec = spec(&["usage.prompt_tokens", "usage.completion_tokens"]);
    let content_type = "application/json; charset=utf-8";
    assert_eq!(meter_whole(&spec, content_type, OPENAI_BODY.as_bytes()), Ok(1117 + 46));
    assert_eq!(meter_in_chunks(&spec, content_type, OPENAI_BODY.as_bytes(), 1), Ok(1117 + 46));
}

#[test]
fn openai_json_body_total_tokens_alone() {
    let spec = spec(&["usage.total_tokens"]);
    assert_eq!(meter_whole(&spec, "application/json", OPENAI_BODY.as_bytes()), Ok(1163));
    assert_eq!(meter_in_chunks(&spec, "application/json", OPENAI_BODY.as_bytes(), 1), Ok(1163));
}

#[test]
fn json_content_types_are_recognised_whatever_their_case_and_parameters() {
    let spec = spec(&["usage.total_tokens"]);
    let body = br#"{"usage":{"total_tokens":3}}"#;
    for content_type in ["APPLICATION/JSON", "application/vnd.api+json; charset=UTF-8", " application/problem+JSON "] {
        assert_eq!(meter_whole(&spec, content_type, body), Ok(3), "{content_type}");
    }
    for content_type in ["application/jsonl", "application/+json", "text/json", "application", ""] {
        assert_eq!(meter_whole(&spec, content_type, body), Err(UsageProblem::NotJson), "{content_type}");
    }
}

#[test]
fn json_body_key_written_with_escapes_is_found() {
    let spec = spec(&["usage.total_tokens"]);
    let body = br#"{"us\u0061ge":{"total_tokens":8}}"#;
    assert_eq!(meter_whole(&spec, "application/json", body), Ok(8));
}

#[test]
fn json_body_with_byte_order_mark_is_read() {
    let spec = spec(&["usage.total_tokens"]);
    let body = b"\xEF\xBB\xBF{\"usage\":{\"total_tokens\":4}}";
    assert_eq!(meter_in_chunks(&spec, "application/json", body, 1), Ok(4));
}

#[test]
fn fields_sharing_a_prefix_are_all_read() {
    let spec = spec(&["a.b.c", "a.b", "a.bb", "a.b.d", "z"]);
    let body = br#"{"a":{"b":{"d":2,"c":1},"bb":10},"z":100,"b":{"c":1000}}"#;
    // `a.b` is an object, not a count.
    assert_eq!(meter_whole(&spec, "application/json", body), Err(UsageProblem::Missing("a.b".into())));
    let spec = self::spec(&["a.b.c", "a.bb", "a.b.d", "z"]);
    assert_eq!(meter_whole(&spec, "application/json", body), Ok(113));
}

const OPENAI_STREAM: &str = concat!(
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,",
    "\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},",
    "\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
    "\"delta\":{\"content\":\"Héllo ✓\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
    "\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"choices\":[],",
    "\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":10,\"total_tokens\":29}}\n\n",
    "data: [DONE]\n\n",
);

#[test]
fn openai_stream_gives_the_same_cost_at_every_split() {
    let spec = spec(&["usage.prompt_tokens", "usage.completion_tokens"]);
    assert_every_split(&spec, "text/event-stream", OPENAI_STREAM.as_bytes(), Ok(29));
    assert_eq!(meter_in_chunks(&spec, "text/event-stream; charset=utf-8", OPENAI_STREAM.as_bytes(), 1), Ok(29));
    let total = self::spec(&["usage.total_tokens"]);
    assert_every_split(&total, "Text/Event-Stream", OPENAI_STREAM.as_bytes(), Ok(29));
}

const ANTHROPIC_STREAM: &str = concat!(
    "event: message_start\r\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",",
    "\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,",
    "\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n",
    "event: content_block_start\r\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\r\n\r\n",
    "event: ping\r\n",
    "data: {\"type\": \"ping\"}\r\n\r\n",
    "event: content_block_delta\r\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\r\n\r\n",
    "event: content_block_delta\r\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\r\n\r\n",
    "event: content_block_stop\r\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\r\n\r\n",
    "event: message_delta\r\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},",
    "\"usage\":{\"output_tokens\":15}}\r\n\r\n",
    "event: message_delta\r\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},",
    "\"usage\":{\"output_tokens\":40}}\r\n\r\n",
    "event: message_stop\r\n",
    "data: {\"type\":\"message_stop\"}\r\n\r\n",
);

#[test]
fn anthropic_stream_with_crlf_split_anywhere_counts_the_last_cumulative_values() {
    let spec = spec(&["message.usage.input_tokens", "usage.output_tokens"]);
    let body = ANTHROPIC_STREAM.as_bytes();
    assert_every_split(&spec, "text/event-stream", body, Ok(25 + 40));
    assert_eq!(meter_in_chunks(&spec, "text/event-stream", body, 1), Ok(65));
    assert_eq!(meter_in_chunks(&spec, "text/event-stream", body, 7), Ok(65));
    // Split exactly inside every `\r\n`.
    let mut meter = UsageMeter::new(spec.clone(), Some("text/event-stream"));
    for piece in ANTHROPIC_STREAM.split_inclusive('\r') {
        meter.feed(piece.as_bytes());
    }
    assert_eq!(meter.finish(), Ok(65));
    // The last event's JSON over two data lines: `\r\n` between them must not end the event.
    let two_lines =
        ANTHROPIC_STREAM.replace(",\"usage\":{\"output_tokens\":40}", ",\r\ndata: \"usage\":{\"output_tokens\":40}");
    assert_ne!(two_lines, ANTHROPIC_STREAM);
    assert_every_split(&spec, "text/event-stream", two_lines.as_bytes(), Ok(65));
}

#[test]
fn stream_line_ends_comments_and_multiline_data_follow_the_format() {
    let spec = spec(&["usage.total_tokens"]);
    let streams: [(&str, Result<u64, UsageProblem>); 11] = [
        ("data: {\"usage\":{\"total_tokens\":1}}\n\n", Ok(1)),
        ("data: {\"usage\":{\"total_tokens\":2}}\r\r", Ok(2)),
        ("data: {\"usage\":{\"total_tokens\":3}}\r\n\r\n", Ok(3)),
        // No space after the colon; comments, ids, retry and unknown fields ignored.
        (
            ": keep-alive\nid: 7\nretry: 10\nevent: x\nfoo: {\"usage\":{\"total_tokens\":9}}\ndata:{\"usage\":{\"total_tokens\":4}}\n\n",
            Ok(4),
        ),
        // One JSON object over two data lines.
        ("data: {\"usage\":\ndata: {\"total_tokens\":5}}\n\n", Ok(5)),
        ("data: {\"usage\":\r\ndata: {\"total_tokens\":5}}\r\n\r\n", Ok(5)),
        ("data: {\"usage\":\rdata: {\"total_tokens\":5}}\r\r", Ok(5)),
        // Only one space is dropped: a second one is still whitespace before the JSON.
        ("data:  {\"usage\":{\"total_tokens\":6}}\n\n", Ok(6)),
        // `datum:` and `Data:` are not data.
        (
            "datum: {\"usage\":{\"total_tokens\":7}}\n\nData: {\"usage\":{\"total_tokens\":7}}\n\n",
            Err(UsageProblem::Missing("usage.total_tokens".into())),
        ),
        // Two events: the last one wins; a non-object event between them is skipped.
        ("data: {\"usage\":{\"total_tokens\":8}}\n\ndata: 42\n\ndata: {\"usage\":{\"total_tokens\":9}}\n\n", Ok(9)),
        // A malformed event gives nothing, not even its fields before the error.
        ("data: {\"usage\":{\"total_tokens\":10}}\n\ndata: {\"usage\":{\"total_tokens\":11}} x\n\n", Ok(10)),
    ];
    for (stream, expected) in streams {
        assert_every_split(&spec, "text/event-stream", stream.as_bytes(), expected);
    }
}

#[test]
fn unterminated_last_event_is_read_at_the_end() {
    let spec = spec(&["usage.total_tokens"]);
    for stream in ["data: {\"usage\":{\"total_tokens\":12}}", "data: {\"usage\":{\"total_tokens\":12}}\r"] {
        assert_every_split(&spec, "text/event-stream", stream.as_bytes(), Ok(12));
    }
}

#[test]
fn stream_byte_order_mark_is_dropped_at_any_split() {
    let spec = spec(&["usage.total_tokens"]);
    assert_every_split(&spec, "text/event-stream", b"\xEF\xBB\xBFdata: {\"usage\":{\"total_tokens\":13}}\n\n", Ok(13));
    // Only at the very start, and only a whole one.
    let missing = Err(UsageProblem::Missing("usage.total_tokens".into()));
    assert_every_split(&spec, "text/event-stream", b"\xEF\xBBdata: {\"usage\":{\"total_tokens\":13}}\n\n", missing);
}

#[test]
fn stream_event_with_invalid_utf8_in_a_string_still_counts() {
    let spec = spec(&["usage.total_tokens"]);
    let stream = b"data: {\"text\":\"\xFF\xC3\",\"usage\":{\"total_tokens\":14}}\n\n";
    assert_every_split(&spec, "text/event-stream", stream, Ok(14));
}

#[test]
fn missing_field_is_named() {
    let spec = spec(&["usage.prompt_tokens", "usage.cached_tokens"]);
    let body = br#"{"usage":{"prompt_tokens":3}}"#;
    assert_eq!(meter_whole(&spec, "application/json", body), Err(UsageProblem::Missing("usage.cached_tokens".into())));
    let stream = b"data: {\"usage\":{\"prompt_tokens\":3}}\n\n";
    assert_eq!(
        meter_whole(&spec, "text/event-stream", stream),
        Err(UsageProblem::Missing("usage.cached_tokens".into()))
    );
    // An intermediate value that is not an object hides the field too.
    let body = br#"{"usage":null}"#;
    assert_eq!(meter_whole(&spec, "application/json", body), Err(UsageProblem::Missing("usage.prompt_tokens".into())));
}

#[test]
fn negative_fractional_string_or_null_field_is_missing() {
    let spec = spec(&["usage.total_tokens"]);
    for value in ["-1", "\"12\"", "1.5", "null", "true", "[1]", "{\"n\":1}", "-0.5"] {
        let body = format!(r#"{{"usage":{{"total_tokens":{value}}}}}"#);
        assert_eq!(
            meter_whole(&spec, "application/json", body.as_bytes()),
            Err(UsageProblem::Missing("usage.total_tokens".into())),
            "{value}"
        );
        let stream = format!("data: {body}\n\n");
        assert_eq!(
            meter_whole(&spec, "text/event-stream", stream.as_bytes()),
            Err(UsageProblem::Missing("usage.total_tokens".into())),
            "{value}"
        );
    }
    // In a stream a bad value is ignored, not an error: an earlier good one stays.
    let stream = "data: {\"usage\":{\"total_tokens\":5}}\n\ndata: {\"usage\":{\"total_tokens\":-1}}\n\n";
    assert_eq!(meter_whole(&spec, "text/event-stream", stream.as_bytes()), Ok(5));
}

#[test]
fn whole_float_counts() {
    let spec = spec(&["usage.total_tokens"]);
    assert_eq!(meter_whole(&spec, "application/json", br#"{"usage":{"total_tokens":12.0}}"#), Ok(12));
    assert_eq!(meter_whole(&spec, "application/json", br#"{"usage":{"total_tokens":1e3}}"#), Ok(1000));
}

#[test]
fn sum_beyond_two_to_the_53_overflows() {
    let spec = spec(&["a", "b"]);
    let at_bound = format!(r#"{{"a":{},"b":0}}"#, MAX_COST);
    assert_eq!(meter_whole(&spec, "application/json", at_bound.as_bytes()), Ok(MAX_COST));
    let beyond = format!(r#"{{"a":{},"b":1}}"#, MAX_COST);
    assert_eq!(meter_whole(&spec, "application/json", beyond.as_bytes()), Err(UsageProblem::Overflow));
    let beyond_u64 = format!(r#"{{"a":{},"b":1}}"#, u64::MAX);
    assert_eq!(meter_whole(&spec, "application/json", beyond_u64.as_bytes()), Err(UsageProblem::Overflow));
    let huge = br#"{"a":1e300,"b":1}"#;
    assert_eq!(meter_whole(&spec, "application/json", huge), Err(UsageProblem::Overflow));
    let past_u64 = br#"{"a":18446744073709551616,"b":1}"#;
    assert_eq!(meter_whole(&spec, "application/json", past_u64), Err(UsageProblem::Overflow));
}

#[test]
fn malformed_json_body_is_reported() {
    let spec = spec(&["usage.total_tokens"]);
    for body in [&b""[..], b"{\"usage\":", b"{\"usage\":{\"total_tokens\":1}} trailing", b"\xFF"] {
        let result = meter_whole(&spec, "application/json", body);
        assert!(matches!(result, Err(UsageProblem::Malformed(_))), "{body:?}: {result:?}");
    }
}

#[test]
fn json_body_over_the_bound_is_too_large_and_released() {
    let mut bounded = UsageSpec::new(vec![JsonPath::parse("usage.total_tokens").unwrap()]).unwrap();
    let body = br#"{"usage":{"total_tokens":17}}"#;
    bounded.max_json_bytes = body.len();
    let at_bound = Arc::new(bounded.clone());
    assert_eq!(meter_in_chunks(&at_bound, "application/json", body, 3), Ok(17));
    bounded.max_json_bytes = body.len() - 1;
    let below = Arc::new(bounded);
    let mut meter = UsageMeter::new(below.clone(), Some("application/json"));
    for piece in body.chunks(3) {
        meter.feed(piece);
        assert!(meter.buffered_bytes() <= below.max_json_bytes);
    }
    assert_eq!(meter.buffered_bytes(), 0);
    assert_eq!(meter.finish(), Err(UsageProblem::TooLarge(body.len() - 1)));
}

#[test]
fn other_content_types_are_not_json_and_hold_nothing() {
    let spec = spec(&["usage.total_tokens"]);
    let body = br#"{"usage":{"total_tokens":1}}"#;
    let mut meter = UsageMeter::new(spec.clone(), Some("text/plain"));
    meter.feed(body);
    assert_eq!(meter.buffered_bytes(), 0);
    assert_eq!(meter.finish(), Err(UsageProblem::NotJson));
    let mut meter = UsageMeter::new(spec, None);
    meter.feed(body);
    assert_eq!(meter.finish(), Err(UsageProblem::NotJson));
}

#[test]
fn done_only_stream_is_missing() {
    let spec = spec(&["usage.total_tokens"]);
    let missing = Err(UsageProblem::Missing("usage.total_tokens".into()));
    assert_eq!(meter_whole(&spec, "text/event-stream", b"data: [DONE]\n\n"), missing);
    assert_eq!(meter_whole(&spec, "text/event-stream", b""), missing);
}

#[test]
fn oversized_event_is_skipped_and_later_events_count() {
    let spec = spec(&["usage.total_tokens"]);
    let padding = "x".repeat(MAX_EVENT_BYTES);
    let big = |tokens: u64| format!("data: {{\"usage\":{{\"total_tokens\":{tokens}}},\"pad\":\"{padding}\"}}\n\n");
    // Over the bound only when its data lines are joined.
    let big_over_lines = format!(
        "data: {{\"usage\":{{\"total_tokens\":1001}},\ndata: \"pad\":\"{}\"}}\n\n",
        "y".repeat(MAX_EVENT_BYTES - 40)
    );
    let stream = format!("{}data: {{\"usage\":{{\"total_tokens\":5}}}}\n\n{}{big_over_lines}", big(999), big(1000));
    for chunk in [1, 10, 4096, stream.len()] {
        let mut meter = UsageMeter::new(spec.clone(), Some("text/event-stream"));
        for piece in stream.as_bytes().chunks(chunk) {
            meter.feed(piece);
            assert!(meter.buffered_bytes() <= MAX_EVENT_BYTES, "chunks of {chunk}");
        }
        assert_eq!(meter.finish(), Ok(5), "chunks of {chunk}");
    }
    // An event just within the bound counts.
    let fits =
        format!("data: {{\"usage\":{{\"total_tokens\":6}},\"pad\":\"{}\"}}\n\n", "z".repeat(MAX_EVENT_BYTES - 50));
    assert!(fits.len() - "data: \n\n".len() <= MAX_EVENT_BYTES);
    assert_eq!(meter_in_chunks(&spec, "text/event-stream", fits.as_bytes(), 1000), Ok(6));
}

#[test]
fn endless_line_in_many_small_frames_stays_bounded() {
    let spec = spec(&["usage.total_tokens"]);
    let mut meter = UsageMeter::new(spec, Some("text/event-stream"));
    meter.feed(b"data: ");
    for _ in 0..(4 * 1024 * 1024 / 16) {
        meter.feed(b"0123456789abcdef");
    }
    assert!(meter.buffered_bytes() <= MAX_EVENT_BYTES);
    meter.feed(b"\n\ndata: {\"usage\":{\"total_tokens\":2}}\n\n");
    assert_eq!(meter.finish(), Ok(2));
}

#[test]
fn cost_from_header_takes_digits_only() {
    assert_eq!(cost_from_header(b"0"), Ok(0));
    assert_eq!(cost_from_header(b"1234"), Ok(1234));
    assert_eq!(cost_from_header(b"007"), Ok(7));
    assert_eq!(cost_from_header(b"999999999999999"), Ok(999_999_999_999_999));
    for bad in [&b""[..], b"-1", b"+1", b" 1", b"1 ", b"1.0", b"1e3", b"0x10", b"1234567890123456", b"\xFF"] {
        assert!(matches!(cost_from_header(bad), Err(UsageProblem::Malformed(_))), "{bad:?}");
    }
}

#[test]
fn json_path_parse_refuses_bad_paths() {
    assert_eq!(JsonPath::parse(""), Err(UsageSpecError::EmptyPath));
    assert_eq!(JsonPath::parse("a..b"), Err(UsageSpecError::EmptySegment("a..b".into())));
    assert_eq!(JsonPath::parse(".a"), Err(UsageSpecError::EmptySegment(".a".into())));
    assert_eq!(JsonPath::parse("a."), Err(UsageSpecError::EmptySegment("a.".into())));
    assert_eq!(JsonPath::parse("a.b.c.d.e.f.g.h.i"), Err(UsageSpecError::TooManySegments("a.b.c.d.e.f.g.h.i".into())));
    assert_eq!(JsonPath::parse("usage.total tokens"), Err(UsageSpecError::Character("usage.total tokens".into(), ' ')));
    assert_eq!(JsonPath::parse("usagé"), Err(UsageSpecError::Character("usagé".into(), 'é')));
    let long = "a".repeat(MAX_SEGMENT_CHARS + 1);
    assert_eq!(JsonPath::parse(&long), Err(UsageSpecError::SegmentTooLong(long.clone())));
    assert!(UsageSpecError::EmptySegment("a..b".into()).to_string().contains("a..b"));

    let path = JsonPath::parse("message.usage.input_tokens").unwrap();
    assert_eq!(path.segments(), ["message", "usage", "input_tokens"]);
    assert_eq!(path.as_str(), "message.usage.input_tokens");
    assert_eq!(path.to_string(), "message.usage.input_tokens");
    assert!(JsonPath::parse("a.b.c.d.e.f.g.h").is_ok());
    assert!(JsonPath::parse(&"a".repeat(MAX_SEGMENT_CHARS)).is_ok());
    assert!("x-y_Z.0".parse::<JsonPath>().is_ok());
}

#[test]
fn usage_spec_new_refuses_bad_field_lists() {
    let path = |p: &str| JsonPath::parse(p).unwrap();
    assert_eq!(UsageSpec::new(vec![]), Err(UsageSpecError::NoFields));
    let nine = (0..9).map(|i| path(&format!("f{i}"))).collect();
    assert_eq!(UsageSpec::new(nine), Err(UsageSpecError::TooManyFields(9)));
    assert_eq!(UsageSpec::new(vec![path("a"), path("b"), path("a")]), Err(UsageSpecError::DuplicateField("a".into())));
    let spec = UsageSpec::new(vec![path("a")]).unwrap();
    assert_eq!(spec.max_json_bytes, DEFAULT_MAX_JSON_BYTES);
}

#[test]
fn meter_built_from_an_unchecked_spec_does_not_panic() {
    let no_fields = Arc::new(UsageSpec { fields: vec![], max_json_bytes: 0 });
    assert!(matches!(meter_whole(&no_fields, "application/json", b""), Err(UsageProblem::Malformed(_))));
    assert_eq!(meter_whole(&no_fields, "application/json", b"{}"), Err(UsageProblem::TooLarge(0)));
    assert_eq!(meter_whole(&no_fields, "text/event-stream", b"data: {}\n\n"), Ok(0));
    let repeated = JsonPath::parse("n").unwrap();
    let many = Arc::new(UsageSpec { fields: vec![repeated; 20], max_json_bytes: 100 });
    assert_eq!(meter_whole(&many, "application/json", br#"{"n":2}"#), Ok(40));
}
