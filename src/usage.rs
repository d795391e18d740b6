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
mod tests {
    use super::*;

    fn spec(paths: &[&str]) -> Arc<UsageSpec> {
        let fields = paths.iter().map(|p| JsonPath::parse(p).unwrap()).collect();
        Arc::new(UsageSpec::new(fields).unwrap())
    }

    fn meter_in_chunks(
        spec: &Arc<UsageSpec>,
        content_type: &str,
        body: &[u8],
        chunk: usize,
    ) -> Result<u64, UsageProblem> {
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
        for content_type in
            ["APPLICATION/JSON", "application/vnd.api+json; charset=UTF-8", " application/problem+JSON "]
        {
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
        let two_lines = ANTHROPIC_STREAM
            .replace(",\"usage\":{\"output_tokens\":40}", ",\r\ndata: \"usage\":{\"output_tokens\":40}");
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
        assert_every_split(
            &spec,
            "text/event-stream",
            b"\xEF\xBB\xBFdata: {\"usage\":{\"total_tokens\":13}}\n\n",
            Ok(13),
        );
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
        assert_eq!(
            meter_whole(&spec, "application/json", body),
            Err(UsageProblem::Missing("usage.cached_tokens".into()))
        );
        let stream = b"data: {\"usage\":{\"prompt_tokens\":3}}\n\n";
        assert_eq!(
            meter_whole(&spec, "text/event-stream", stream),
            Err(UsageProblem::Missing("usage.cached_tokens".into()))
        );
        // An intermediate value that is not an object hides the field too.
        let body = br#"{"usage":null}"#;
        assert_eq!(
            meter_whole(&spec, "application/json", body),
            Err(UsageProblem::Missing("usage.prompt_tokens".into()))
        );
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
        assert_eq!(
            JsonPath::parse("a.b.c.d.e.f.g.h.i"),
            Err(UsageSpecError::TooManySegments("a.b.c.d.e.f.g.h.i".into()))
        );
        assert_eq!(
            JsonPath::parse("usage.total tokens"),
            Err(UsageSpecError::Character("usage.total tokens".into(), ' '))
        );
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
        assert_eq!(
            UsageSpec::new(vec![path("a"), path("b"), path("a")]),
            Err(UsageSpecError::DuplicateField("a".into()))
        );
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
}
