//! The cost a response reports about itself: LLM token usage read from the body as it streams
//! past, or a header that states the cost.
//!
//! The sidecar forwards a response byte for byte and cannot hold it back to read it, so a
//! [`UsageMeter`] watches the frames go by and answers only at the end of the body:
//!
//! - a JSON body (`application/json`, `application/*+json`) is copied up to
//!   [`UsageSpec::max_json_bytes`] and parsed once complete; past the bound the copy is dropped
//!   and the cost is [`UsageProblem::TooLarge`], so a huge body costs no more memory than a
//!   small one;
//! - a server-sent event stream (`text/event-stream`) is parsed incrementally, one event at a
//!   time: only the event being assembled is held (at most [`MAX_EVENT_BYTES`]), each event's
//!   JSON is read for the cost fields and dropped, and the last value seen for each field is the
//!   one that counts (streamed LLM APIs report usage in a late event, or cumulatively);
//! - anything else is [`UsageProblem::NotJson`] and holds nothing.
//!
//! The meter sees the bytes as they travel: a compressed body (`Content-Encoding: gzip`) does
//! not parse. Nothing here panics on any input, and the work is linear in the body's size
//! whatever the frame sizes.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Most segments of a [`JsonPath`].
pub const MAX_PATH_SEGMENTS: usize = 8;
/// Most characters of one segment of a [`JsonPath`].
pub const MAX_SEGMENT_CHARS: usize = 64;
/// Most fields a [`UsageSpec`] sums.
pub const MAX_FIELDS: usize = 8;
/// The default bound on the copy of a non-streamed JSON body.
pub const DEFAULT_MAX_JSON_BYTES: usize = 1024 * 1024;
/// Most bytes of one server-sent event's data: a larger event is skipped. Usage events are a
/// few hundred bytes; the bound only stops one endless event from growing the meter.
pub const MAX_EVENT_BYTES: usize = 64 * 1024;
/// The largest cost: costs travel through Redis scripts as doubles, exact up to 2^53.
pub const MAX_COST: u64 = 1 << 53;
/// Most digits of a cost header: every 15-digit number is below [`MAX_COST`].
pub const MAX_HEADER_DIGITS: usize = 15;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// A dotted path into a JSON object, e.g. `usage.total_tokens` or `message.usage.input_tokens`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath(Vec<String>);

impl JsonPath {
    /// Parses `a.b.c`: 1 to 8 segments, each 1 to 64 characters of `[A-Za-z0-9_-]`.
    pub fn parse(text: &str) -> Result<JsonPath, UsageSpecError> {
        if text.is_empty() {
            return Err(UsageSpecError::EmptyPath);
        }
        let mut segments = Vec::new();
        for segment in text.split('.') {
            if segment.is_empty() {
                return Err(UsageSpecError::EmptySegment(text.to_string()));
            }
            if segments.len() == MAX_PATH_SEGMENTS {
                return Err(UsageSpecError::TooManySegments(text.to_string()));
            }
            if let Some(bad) = segment.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')) {
                return Err(UsageSpecError::Character(text.to_string(), bad));
            }
            // Only ASCII is left, so bytes are characters.
            if segment.len() > MAX_SEGMENT_CHARS {
                return Err(UsageSpecError::SegmentTooLong(text.to_string()));
            }
            segments.push(segment.to_string());
        }
        Ok(JsonPath(segments))
    }

    /// The path as written: segments joined with dots.
    pub fn as_str(&self) -> String {
        self.0.join(".")
    }

    /// The object keys to follow, outermost first.
    pub fn segments(&self) -> &[String] {
        &self.0
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

impl FromStr for JsonPath {
    type Err = UsageSpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        JsonPath::parse(text)
    }
}

/// Why a [`JsonPath`] or [`UsageSpec`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageSpecError {
    #[error("empty JSON path; write dotted field names such as usage.total_tokens")]
    EmptyPath,
    #[error("JSON path {0:?}: empty segment (a leading, trailing or doubled dot)")]
    EmptySegment(String),
    #[error("JSON path {0:?}: more than {MAX_PATH_SEGMENTS} segments")]
    TooManySegments(String),
    #[error("JSON path {0:?}: a segment is longer than {MAX_SEGMENT_CHARS} characters")]
    SegmentTooLong(String),
    #[error("JSON path {0:?}: character {1:?} not allowed; segments are letters, digits, '_' and '-'")]
    Character(String, char),
    #[error("no cost fields: name 1 to {MAX_FIELDS} JSON paths to sum")]
    NoFields,
    #[error("{0} cost fields: at most {MAX_FIELDS} JSON paths are summed")]
    TooManyFields(usize),
    #[error("cost field {0} is named twice")]
    DuplicateField(String),
}

/// What a response's cost is read from: the sum of `fields`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageSpec {
    /// 1 to [`MAX_FIELDS`] paths, summed.
    pub fields: Vec<JsonPath>,
    /// Most bytes of a non-streamed JSON body kept to find the fields (default 1 MiB).
    pub max_json_bytes: usize,
}

impl UsageSpec {
    /// A spec summing `fields` (1 to 8, no repeats), with the default JSON body bound.
    pub fn new(fields: Vec<JsonPath>) -> Result<UsageSpec, UsageSpecError> {
        if fields.is_empty() {
            return Err(UsageSpecError::NoFields);
        }
        if fields.len() > MAX_FIELDS {
            return Err(UsageSpecError::TooManyFields(fields.len()));
        }
        for (i, field) in fields.iter().enumerate() {
            if fields[..i].contains(field) {
                return Err(UsageSpecError::DuplicateField(field.as_str()));
            }
        }
        Ok(UsageSpec { fields, max_json_bytes: DEFAULT_MAX_JSON_BYTES })
    }
}

/// Why a response's cost could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageProblem {
    /// The content type is neither JSON nor server-sent events (or there is none).
    #[error("the response is neither JSON nor text/event-stream")]
    NotJson,
    /// The JSON body is larger than the bound (carried).
    #[error("the JSON response body is larger than {0} bytes")]
    TooLarge(usize),
    /// The JSON body, or a cost header, does not parse.
    #[error("unreadable cost: {0}")]
    Malformed(String),
    /// A field (its path carried) is absent or not a non-negative integer.
    #[error("cost field {0} is absent or not a non-negative integer")]
    Missing(String),
    /// The sum is beyond 2^53.
    #[error("the cost is beyond 2^53")]
    Overflow,
}

/// Reads the cost of one response from its body, frame by frame.
pub struct UsageMeter {
    spec: Arc<UsageSpec>,
    /// Indices into `spec.fields`, ordered by path so that the fields under one object key are
    /// a contiguous run (see [`FieldSelector`]).
    by_path: Vec<usize>,
    body: Body,
}

enum Body {
    Json(JsonCopy),
    Sse(Box<SseReader>),
    Other,
}

enum JsonCopy {
    Copying(Vec<u8>),
    TooLarge,
}

impl UsageMeter {
    /// A meter for a response whose Content-Type header is `content_type`, if any.
    pub fn new(spec: Arc<UsageSpec>, content_type: Option<&str>) -> UsageMeter {
        let mut by_path: Vec<usize> = (0..spec.fields.len()).collect();
        by_path.sort_by(|&a, &b| spec.fields[a].0.cmp(&spec.fields[b].0));
        let body = match content_type.map(classify) {
            Some(Kind::Json) => Body::Json(JsonCopy::Copying(Vec::new())),
            Some(Kind::EventStream) => Body::Sse(Box::new(SseReader::new(spec.fields.len()))),
            Some(Kind::Other) | None => Body::Other,
        };
        UsageMeter { spec, by_path, body }
    }

    /// Reads the next frame of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match &mut self.body {
            Body::Json(copy) => {
                if let JsonCopy::Copying(buf) = copy
                    && !push_bounded(buf, chunk, self.spec.max_json_bytes)
                {
                    // Dropped at once: the answer is known and the copy would only hold memory.
                    *copy = JsonCopy::TooLarge;
                }
            }
            Body::Sse(reader) => reader.feed(chunk, Fields { paths: &self.spec.fields, by_path: &self.by_path }),
            Body::Other => {}
        }
    }

    /// The cost: the sum of the fields, once the body has ended.
    pub fn finish(self) -> Result<u64, UsageProblem> {
        let fields = Fields { paths: &self.spec.fields, by_path: &self.by_path };
        match self.body {
            Body::Other => Err(UsageProblem::NotJson),
            Body::Json(JsonCopy::TooLarge) => Err(UsageProblem::TooLarge(self.spec.max_json_bytes)),
            Body::Json(JsonCopy::Copying(buf)) => {
                // RFC 8259 lets a parser ignore a byte order mark; serde_json does not.
                let json = buf.strip_prefix(UTF8_BOM).unwrap_or(&buf);
                let mut found = vec![None; fields.paths.len()];
                select_fields(json, fields, &mut found)
                    .map_err(|error| UsageProblem::Malformed(format!("JSON body: {error}")))?;
                let values = found.iter().zip(fields.paths).map(|(value, path)| match value {
                    Some(Found::Count(count)) => Ok(*count),
                    Some(Found::NotACount) | None => Err(UsageProblem::Missing(path.as_str())),
                });
                sum(values)
            }
            Body::Sse(mut reader) => {
                reader.finish(fields);
                let values = reader
                    .last_seen
                    .iter()
                    .zip(fields.paths)
                    .map(|(value, path)| value.ok_or_else(|| UsageProblem::Missing(path.as_str())));
                sum(values)
            }
        }
    }

    /// The bytes of body the meter holds now (allocated capacity): at most `max_json_bytes` for a
    /// JSON body, [`MAX_EVENT_BYTES`] for an event stream, nothing otherwise.
    pub fn buffered_bytes(&self) -> usize {
        match &self.body {
            Body::Json(JsonCopy::Copying(buf)) => buf.capacity(),
            Body::Sse(reader) => reader.data.capacity(),
            Body::Json(JsonCopy::TooLarge) | Body::Other => 0,
        }
    }
}

/// The value of a response header that states the cost itself (e.g. `x-sluice-cost: 1234`):
/// 1 to 15 ASCII decimal digits, nothing else (no sign, space or point).
pub fn cost_from_header(value: &[u8]) -> Result<u64, UsageProblem> {
    if value.is_empty() || value.len() > MAX_HEADER_DIGITS || !value.iter().all(u8::is_ascii_digit) {
        // Bounded: the header could be anything the application sent.
        let shown: String = value.iter().take(32).flat_map(|b| b.escape_ascii()).map(char::from).collect();
        let more = if value.len() > 32 { "…" } else { "" };
        return Err(UsageProblem::Malformed(format!(
            "cost header {shown:?}{more}: expected 1 to {MAX_HEADER_DIGITS} decimal digits"
        )));
    }
    // At most 15 digits: no overflow possible.
    Ok(value.iter().fold(0u64, |total, digit| total * 10 + u64::from(digit - b'0')))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Json,
    EventStream,
    Other,
}

fn classify(content_type: &str) -> Kind {
    let essence = content_type.split(';').next().unwrap_or("").trim_matches(|c: char| c == ' ' || c == '\t');
    let Some((kind, subtype)) = essence.split_once('/') else {
        return Kind::Other;
    };
    let structured_json = subtype.len() > "+json".len()
        && subtype.get(subtype.len() - "+json".len()..).is_some_and(|tail| tail.eq_ignore_ascii_case("+json"));
    if kind.eq_ignore_ascii_case("application") && (subtype.eq_ignore_ascii_case("json") || structured_json) {
        Kind::Json
    } else if kind.eq_ignore_ascii_case("text") && subtype.eq_ignore_ascii_case("event-stream") {
        Kind::EventStream
    } else {
        Kind::Other
    }
}

fn sum(values: impl Iterator<Item = Result<u64, UsageProblem>>) -> Result<u64, UsageProblem> {
    let mut total: u64 = 0;
    for value in values {
        total = total.checked_add(value?).ok_or(UsageProblem::Overflow)?;
    }
    if total > MAX_COST { Err(UsageProblem::Overflow) } else { Ok(total) }
}

/// Appends `bytes` unless `buf` would then exceed `limit` (then returns false and leaves `buf`
/// alone). Capacity grows geometrically but never past `limit`, so the bound is on memory, not
/// just on length.
fn push_bounded(buf: &mut Vec<u8>, bytes: &[u8], limit: usize) -> bool {
    let Some(needed) = buf.len().checked_add(bytes.len()).filter(|&needed| needed <= limit) else {
        return false;
    };
    if needed > buf.capacity() {
        let target = needed.max(buf.capacity().saturating_mul(2)).min(limit);
        buf.reserve_exact(target - buf.len());
    }
    buf.extend_from_slice(bytes);
    true
}

/// The incremental `text/event-stream` parser (the WHATWG "event stream interpretation"),
/// keeping only the data of the event being assembled.
struct SseReader {
    /// Some(n) while the stream's first n bytes are the start of a UTF-8 byte order mark, which
    /// the format says to drop; None once past it.
    bom_seen: Option<usize>,
    line: Line,
    /// The previous byte ended a line with `\r`: a `\n` next is part of the same line end, even
    /// in the next frame.
    after_cr: bool,
    /// The current event's data lines, joined with `\n`.
    data: Vec<u8>,
    /// A data line was seen since the last dispatch (an empty `data:` line counts).
    has_data: bool,
    /// The current event outgrew [`MAX_EVENT_BYTES`]: its data is dropped until it ends.
    oversized: bool,
    /// Per field (spec order): the last value an event gave it.
    last_seen: Vec<Option<u64>>,
    /// Per field: what the event being read gives it; kept to avoid an allocation per event.
    scratch: Vec<Option<Found>>,
}

/// Where the parser is within a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Reading the field name; `data_prefix` is how many of its bytes match `data` so far, None
    /// once it cannot be `data`. `Some(0)` is a line with nothing on it yet.
    Field { data_prefix: Option<usize> },
    /// Just after `data:`, where one space is dropped.
    DataValueStart,
    /// In the value of a `data` line.
    DataValue,
    /// In any other line (a comment, `event`, `id`, `retry`, unknown fields).
    Ignored,
}

const LINE_START: Line = Line::Field { data_prefix: Some(0) };
const DATA_FIELD: &[u8] = b"data";

impl SseReader {
    fn new(field_count: usize) -> SseReader {
        SseReader {
            bom_seen: Some(0),
            line: LINE_START,
            after_cr: false,
            data: Vec::new(),
            has_data: false,
            oversized: false,
            last_seen: vec![None; field_count],
            scratch: vec![None; field_count],
        }
    }

    fn feed(&mut self, mut chunk: &[u8], fields: Fields<'_>) {
        while let Some(seen) = self.bom_seen {
            let Some((&byte, rest)) = chunk.split_first() else {
                return;
            };
            if UTF8_BOM.get(seen) == Some(&byte) {
                chunk = rest;
                self.bom_seen = if seen + 1 == UTF8_BOM.len() { None } else { Some(seen + 1) };
            } else {
                // Not a byte order mark after all: what looked like one is part of the stream.
                self.bom_seen = None;
                self.scan(UTF8_BOM.get(..seen).unwrap_or_default(), fields);
            }
        }
        self.scan(chunk, fields);
    }

    fn finish(&mut self, fields: Fields<'_>) {
        if let Some(seen) = self.bom_seen.take() {
            self.scan(UTF8_BOM.get(..seen).unwrap_or_default(), fields);
        }
        // Lenient where the format is strict: a last line or event the application did not
        // terminate still counts, since usage is typically in the very last event.
        if self.line != LINE_START {
            self.end_line(fields);
        }
        self.dispatch(fields);
    }

    fn scan(&mut self, chunk: &[u8], fields: Fields<'_>) {
        let mut at = 0;
        while let Some(&byte) = chunk.get(at) {
            if self.after_cr {
                self.after_cr = false;
                if byte == b'\n' {
                    at += 1;
                    continue;
                }
            }
            match self.line {
                Line::Field { data_prefix } => {
                    at += 1;
                    match byte {
                        b'\r' | b'\n' => {
                            self.after_cr = byte == b'\r';
                            self.end_line(fields);
                        }
                        b':' if data_prefix == Some(DATA_FIELD.len()) => {
                            self.start_data_line();
                            self.line = Line::DataValueStart;
                        }
                        b':' => self.line = Line::Ignored,
                        _ => {
                            let data_prefix = data_prefix.filter(|&n| DATA_FIELD.get(n) == Some(&byte)).map(|n| n + 1);
                            self.line = Line::Field { data_prefix };
                        }
                    }
                }
                Line::DataValueStart => {
                    if byte == b' ' {
                        at += 1;
                    }
                    self.line = Line::DataValue;
                }
                Line::DataValue | Line::Ignored => {
                    // Values are long and line ends rare: take the run up to the line end at once.
                    let rest = chunk.get(at..).unwrap_or_default();
                    let run = rest.iter().position(|&b| b == b'\r' || b == b'\n').unwrap_or(rest.len());
                    if self.line == Line::DataValue {
                        self.append_data(rest.get(..run).unwrap_or_default());
                    }
                    at += run;
                    if let Some(&line_end) = rest.get(run) {
                        at += 1;
                        self.after_cr = line_end == b'\r';
                        self.end_line(fields);
                    }
                }
            }
        }
    }

    fn end_line(&mut self, fields: Fields<'_>) {
        match self.line {
            LINE_START => self.dispatch(fields),
            // `data` without a colon: a data line with an empty value.
            Line::Field { data_prefix: Some(n) } if n == DATA_FIELD.len() => self.start_data_line(),
            _ => {}
        }
        self.line = LINE_START;
    }

    fn start_data_line(&mut self) {
        if self.has_data {
            self.append_data(b"\n");
        }
        self.has_data = true;
    }

    fn append_data(&mut self, bytes: &[u8]) {
        if !self.oversized && !push_bounded(&mut self.data, bytes, MAX_EVENT_BYTES) {
            self.oversized = true;
            self.data.clear();
        }
    }

    fn dispatch(&mut self, fields: Fields<'_>) {
        if self.has_data && !self.oversized {
            self.read_event(fields);
        }
        self.data.clear();
        self.has_data = false;
        self.oversized = false;
    }

    fn read_event(&mut self, fields: Fields<'_>) {
        // Most events that are not JSON objects (`[DONE]`, plain text) are skipped unparsed.
        if self.data.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return;
        }
        self.scratch.iter_mut().for_each(|found| *found = None);
        // The format decodes streams as UTF-8 with replacement characters, so an invalid byte
        // inside some string does not lose the event.
        let json = match std::str::from_utf8(&self.data) {
            Ok(_) => Cow::Borrowed(self.data.as_slice()),
            Err(_) => Cow::Owned(String::from_utf8_lossy(&self.data).into_owned().into_bytes()),
        };
        // A malformed event gives nothing, even the fields read before the error.
        if select_fields(&json, fields, &mut self.scratch).is_err() {
            return;
        }
        for (last, found) in self.last_seen.iter_mut().zip(&self.scratch) {
            if let Some(Found::Count(count)) = found {
                *last = Some(*count);
            }
        }
    }
}

/// A spec's fields and their order by path.
#[derive(Clone, Copy)]
struct Fields<'a> {
    paths: &'a [JsonPath],
    by_path: &'a [usize],
}

impl Fields<'_> {
    /// Segment `depth` of field `field` (spec order), "" past its end.
    fn segment(&self, field: usize, depth: usize) -> &str {
        self.paths.get(field).and_then(|path| path.0.get(depth)).map_or("", String::as_str)
    }
}

/// What a JSON document holds at a field's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// A non-negative integer (saturated at `u64::MAX`, which fails the sum's bound).
    Count(u64),
    /// Anything else: a negative or fractional number, a string, null, an array or an object.
    NotACount,
}

/// Parses `json` (one whole document, whitespace around it allowed) and records in `found`
/// (indexed like `fields.paths`) what each path leads to. Only the parts on some path are
/// looked at; the rest is skipped without being built.
fn select_fields(json: &[u8], fields: Fields<'_>, found: &mut [Option<Found>]) -> Result<(), serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(json);
    FieldSelector { fields, depth: 0, start: 0, end: fields.by_path.len(), found }.deserialize(&mut deserializer)?;
    deserializer.end()
}

/// The JSON value reached by following `depth` keys, and the fields (`by_path[start..end]`)
/// whose first `depth` segments are those keys. Ordered by path, those that end here come
/// first, and the rest are grouped by their next segment.
struct FieldSelector<'a, 'f> {
    fields: Fields<'a>,
    depth: usize,
    start: usize,
    end: usize,
    found: &'f mut [Option<Found>],
}

impl FieldSelector<'_, '_> {
    /// Where the fields that go deeper start.
    fn deeper_start(&self) -> usize {
        let candidates = self.fields.by_path.get(self.start..self.end).unwrap_or_default();
        self.start
            + candidates.partition_point(|&field| self.fields.paths.get(field).is_some_and(|p| p.0.len() <= self.depth))
    }

    fn record(&mut self, value: Found) {
        for &field in self.fields.by_path.get(self.start..self.deeper_start()).unwrap_or_default() {
            if let Some(slot) = self.found.get_mut(field) {
                *slot = Some(value);
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for FieldSelector<'_, '_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSelector<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E: de::Error>(mut self, value: u64) -> Result<(), E> {
        self.record(Found::Count(value));
        Ok(())
    }

    fn visit_i64<E: de::Error>(mut self, value: i64) -> Result<(), E> {
        self.record(u64::try_from(value).map_or(Found::NotACount, Found::Count));
        Ok(())
    }

    fn visit_f64<E: de::Error>(mut self, value: f64) -> Result<(), E> {
        // `12.0` and `1e3` are whole; `as` saturates a huge one to u64::MAX, beyond MAX_COST.
        let whole = value.is_finite() && value >= 0.0 && value.fract() == 0.0;
        self.record(if whole { Found::Count(value as u64) } else { Found::NotACount });
        Ok(())
    }

    fn visit_bool<E: de::Error>(mut self, _: bool) -> Result<(), E> {
        self.record(Found::NotACount);
        Ok(())
    }

    fn visit_str<E: de::Error>(mut self, _: &str) -> Result<(), E> {
        self.record(Found::NotACount);
        Ok(())
    }

    fn visit_unit<E: de::Error>(mut self) -> Result<(), E> {
        self.record(Found::NotACount);
        Ok(())
    }

    fn visit_none<E: de::Error>(mut self) -> Result<(), E> {
        self.record(Found::NotACount);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.record(Found::NotACount);
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.record(Found::NotACount);
        let deeper_start = self.deeper_start();
        while let Some((start, end)) =
            map.next_key_seed(KeyMatch { fields: self.fields, depth: self.depth, start: deeper_start, end: self.end })?
        {
            if start == end {
                map.next_value::<IgnoredAny>()?;
            } else {
                let fields = self.fields;
                let depth = self.depth + 1;
                map.next_value_seed(FieldSelector { fields, depth, start, end, found: &mut *self.found })?;
            }
        }
        Ok(())
    }
}

/// An object key, answered with the fields whose next segment it is (`by_path[start..end]`,
/// within the fields going deeper than `depth`).
struct KeyMatch<'a> {
    fields: Fields<'a>,
    depth: usize,
    start: usize,
    end: usize,
}

impl<'de> DeserializeSeed<'de> for KeyMatch<'_> {
    type Value = (usize, usize);

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(usize, usize), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyMatch<'_> {
    type Value = (usize, usize);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    // Borrowed and escaped keys both arrive here, compared without being copied.
    fn visit_str<E: de::Error>(self, key: &str) -> Result<(usize, usize), E> {
        let candidates = self.fields.by_path.get(self.start..self.end).unwrap_or_default();
        let below = candidates.partition_point(|&field| self.fields.segment(field, self.depth) < key);
        let through = candidates.partition_point(|&field| self.fields.segment(field, self.depth) <= key);
        Ok((self.start + below, self.start + through))
    }
}

#[cfg(test)]
mod tests;
