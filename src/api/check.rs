//! `POST /v1/check` (and each check of `POST /v1/checks`): the request a client sends
//! ([`CheckInput`], what the sidecar writes) and the request the endpoint reads ([`CheckRequest`],
//! parsed strictly, so a malformed request gets a 400 that says what is wrong instead of being
//! decided on half-understood input). Both ends use this module; the round-trip test below holds
//! them to the same format.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::request::names::canonical_header_name;
use crate::request::names::is_token;

use crate::engine::MAX_COST;
const MAX_NAME_LEN: usize = 253;
pub const MAX_PATH_LEN: usize = 8192;

/// `POST /v1/check` body, as received.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawCheckRequest {
    namespace: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    method: Option<String>,
    path: String,
    host: Option<String>,
    client_ip: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    cost: Option<u64>,
    #[serde(default)]
    request_fields: BTreeMap<String, u64>,
    egress: Option<String>,
    #[serde(default)]
    wait: bool,
    deadline_ms: Option<u64>,
    slot: Option<String>,
}

/// A validated check request, as the caller stated it; [`CheckRequest::view`] applies what the
/// caller may say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckRequest {
    /// The namespace the caller named, if any.
    pub namespace: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Upper-case HTTP method; `GET` when the caller gave none.
    pub method: String,
    pub path: String,
    pub host: Option<String>,
    pub client_ip: Option<IpAddr>,
    /// Under canonical names ([`canonical_header_name`]): lowercase, `_` as `-`.
    pub headers: BTreeMap<String, String>,
    /// The cost the caller named, if any (1 otherwise).
    pub cost: Option<u64>,
    /// Integer fields of the request's JSON body that rules' `responseCost.estimate` read
    /// (`requestFields: {"max_tokens": 1000}`), as text.
    pub request_fields: BTreeMap<String, String>,
    /// A call to the caller's `spec.egress` downstream of this name: decided by its shaping
    /// rule alone.
    pub egress: Option<String>,
    /// Answer when the slot is due instead of with `delayMs` (Go's `Wait()` to the plain
    /// check's `Reserve()`); a caller leaving first gives its slot back.
    pub wait: bool,
    /// The caller's own deadline (ms): a wait past it is refused at once.
    pub deadline_ms: Option<u64>,
    /// `POST /v1/cancel`: the slots an admission with a wait took (its answer's `slot`).
    pub slot: Option<String>,
}

/// The longest deadline a check may state: a day.
pub const MAX_DEADLINE_MS: u64 = 86_400_000;

/// Most `requestFields` a check may state.
pub const MAX_REQUEST_FIELDS: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

impl CheckRequest {
    /// Parses and validates a JSON body.
    pub fn from_json(body: &[u8]) -> Result<CheckRequest, BadRequest> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(BadRequest("empty body: expected a JSON object with at least \"path\"".into()));
        }
        // Fast path: plain serde_json. Only a body it rejects is parsed again with path tracking,
        // which costs on every field, to say where the problem is. serde_json::from_slice also
        // rejects trailing characters, which the tracked parse (like before) tolerates, so such a
        // body still ends up accepted by the second parse.
        if let Ok(raw) = serde_json::from_slice::<RawCheckRequest>(body) {
            return raw.validate();
        }
        let deserializer = &mut serde_json::Deserializer::from_slice(body);
        let raw: RawCheckRequest = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let what =
                if inner.is_syntax() || inner.is_eof() { format!("invalid JSON: {inner}") } else { inner.to_string() };
            if path == "." || path.is_empty() { BadRequest(what) } else { BadRequest(format!("{path}: {what}")) }
        })?;
        raw.validate()
    }
}

/// The path rule every entry point applies: origin-form (or `*`), at most [`MAX_PATH_LEN`] bytes,
/// and no dot segment next to an encoded separator, which servers read as different resources
/// ([`crate::policy::path`]).
pub fn check_path(path: &str) -> Result<(), BadRequest> {
    if !(path.starts_with('/') || path == "*") {
        return Err(BadRequest(format!("path: must start with '/', got {path:?}")));
    }
    if path.len() > MAX_PATH_LEN {
        return Err(BadRequest(format!("path: longer than {MAX_PATH_LEN} bytes")));
    }
    if crate::policy::path::climbs_through_encoded_separator(path) {
        return Err(BadRequest(format!(
            "path: a dot segment next to an encoded separator (%2F, %5C) is read as different paths by different servers: {path:?}"
        )));
    }
    Ok(())
}

impl RawCheckRequest {
    fn validate(self) -> Result<CheckRequest, BadRequest> {
        if let Some(namespace) = &self.namespace
            && (namespace.is_empty() || namespace.len() > MAX_NAME_LEN)
        {
            return Err(BadRequest(format!("namespace: must be 1 to {MAX_NAME_LEN} characters")));
        }
        let mut method = self.method.unwrap_or_else(|| "GET".to_string());
        method.make_ascii_uppercase();
        if !is_token(&method) {
            return Err(BadRequest(format!("method: {method:?} is not an HTTP method token")));
        }
        check_path(&self.path)?;
        let client_ip = match self.client_ip {
            None => None,
            Some(text) => Some(
                text.trim()
                    .parse::<IpAddr>()
                    .map_err(|_| BadRequest(format!("clientIp: {text:?} is not an IPv4 or IPv6 address")))?,
            ),
        };
        if let Some(name) = self.headers.keys().find(|name| !is_token(name)) {
            return Err(BadRequest(format!("headers: {name:?} is not a valid header name")));
        }
        for (name, value) in &self.headers {
            crate::request::headers::check_used_header_length(name, value.as_bytes()).map_err(BadRequest)?;
        }
        let headers = canonical_headers(self.headers)?;
        if let Some(cost) = self.cost
            && cost > MAX_COST
        {
            return Err(BadRequest(format!("cost: must be at most {MAX_COST}, got {cost}")));
        }
        if self.request_fields.len() > MAX_REQUEST_FIELDS {
            return Err(BadRequest(format!("requestFields: at most {MAX_REQUEST_FIELDS}")));
        }
        if let Some(name) = self.request_fields.keys().find(|n| n.is_empty() || n.len() > 64) {
            return Err(BadRequest(format!("requestFields: {name:?} is not a field name of 1 to 64 characters")));
        }
        if let Some(name) = &self.egress
            && crate::policy::validate::check_rule_name(name).is_err()
        {
            return Err(BadRequest(format!("egress: {name:?} is not an egress entry name")));
        }
        if let Some(ms) = self.deadline_ms
            && ms > MAX_DEADLINE_MS
        {
            return Err(BadRequest(format!("deadlineMs: at most {MAX_DEADLINE_MS} (a day), got {ms}")));
        }
        if let Some(slot) = &self.slot
            && crate::engine::parse_slot(slot).is_none()
        {
            return Err(BadRequest("slot: not a slot this endpoint answered (id:until, comma-separated)".into()));
        }
        Ok(CheckRequest {
            request_fields: self.request_fields.into_iter().map(|(k, v)| (k, v.to_string())).collect(),
            egress: self.egress,
            wait: self.wait,
            deadline_ms: self.deadline_ms,
            slot: self.slot,
            namespace: self.namespace,
            labels: self.labels,
            method,
            path: self.path,
            host: self.host.filter(|h| !h.is_empty()),
            client_ip,
            headers,
            cost: self.cost,
        })
    }
}

/// The stated headers under their canonical names (what rules look up: lowercase, `_` as `-`).
/// Two names of one header (`X-API-Key` and `x_api_key`) state two values for it, and the check
/// is refused rather than one picked.
///
/// The credential header is never among them, as on every entry point
/// ([`crate::request::headers`]): a rule keyed on it would count (and show) callers' tokens.
fn canonical_headers(mut stated: BTreeMap<String, String>) -> Result<BTreeMap<String, String>, BadRequest> {
    // Names are usually canonical already (HTTP/2 requires lowercase); then the map is kept as is.
    if !stated.keys().any(|name| name.bytes().any(|b| b.is_ascii_uppercase() || b == b'_')) {
        stated.remove(crate::request::headers::CREDENTIAL_HEADER);
        return Ok(stated);
    }
    let mut headers: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (name, value) in stated {
        let canonical = canonical_header_name(&name);
        if let Some((other, _)) = headers.get(&canonical) {
            return Err(BadRequest(format!(
                "headers: {other:?} and {name:?} are one header (names ignore case, and CGI and WSGI servers read '_' \
                 as '-'); state it once"
            )));
        }
        headers.insert(canonical, (name, value));
    }
    headers.remove(crate::request::headers::CREDENTIAL_HEADER);
    Ok(headers.into_iter().map(|(canonical, (_, value))| (canonical, value)).collect())
}

/// One request as the limiter sees it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckInput<'a> {
    pub namespace: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub method: &'a str,
    pub path: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<&'a str>,
    pub client_ip: IpAddr,
    pub headers: BTreeMap<String, String>,
    /// Integer fields of the request's JSON body that estimates read (digits only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty", serialize_with = "as_integers")]
    pub request_fields: BTreeMap<String, String>,
    /// A call to this `spec.egress` downstream (the sidecar's egress path).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<&'a str>,
}

impl CheckInput<'_> {
    /// The request as policies read it, costing one: what a holder of the snapshot (the
    /// sidecar's local engine) matches, exactly as the endpoint would match the check.
    pub fn view(&self) -> crate::policy::RequestView<'_> {
        crate::policy::RequestView {
            namespace: self.namespace,
            labels: self.labels,
            method: self.method,
            path: self.path,
            host: self.host,
            client_ip: Some(self.client_ip),
            headers: &self.headers,
            cost: 1,
            fields: &self.request_fields,
            descriptor: None,
            egress: self.egress,
            max_wait: self.deadline_ms.map(|ms| ms.saturating_mul(crate::duration::MICROS_PER_MS)),
        }
    }
}

/// `requestFields` as the check API takes them: JSON integers (they are digits: see
/// `sidecar::proxy`).
fn as_integers<S: serde::Serializer>(fields: &BTreeMap<String, String>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_map(fields.iter().filter_map(|(k, v)| Some((k, v.parse::<u64>().ok()?))))
}

/// One decision as the endpoint answers it: a `POST /v1/check` answer, or one result of
/// `POST /v1/checks` (which may instead say why that check was refused).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckAnswer {
    pub allowed: Option<bool>,
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
    #[serde(default)]
    pub delay_ms: u64,
    #[serde(default, deserialize_with = "header_pairs")]
    pub headers: Vec<(String, String)>,
    /// Set with `error` when this check was refused.
    pub status: Option<u16>,
    pub error: Option<String>,
    /// What an admitted request holds, to release when it ends.
    #[serde(default)]
    pub lease: Option<String>,
    /// An admission with a wait: the slots it took, for `POST /v1/cancel`.
    #[serde(default)]
    pub slot: Option<String>,
    /// A refusing rule's declared body.
    #[serde(default)]
    pub body: Option<String>,
}

/// The `headers` object as name/value pairs in the answer's order, without building a map.
fn header_pairs<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<(String, String)>, D::Error> {
    struct Pairs;
    impl<'de> serde::de::Visitor<'de> for Pairs {
        type Value = Vec<(String, String)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of header names to values")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(6));
            while let Some(pair) = map.next_entry()? {
                pairs.push(pair);
            }
            Ok(pairs)
        }
    }
    deserializer.deserialize_map(Pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        CheckRequest::from_json(body.as_bytes()).unwrap_err().0
    }

    #[test]
    fn parses_the_brief_example() {
        let r = CheckRequest::from_json(
            br#"{"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "post", "path": "/orders/1",
            "host": "api.example.com", "clientIp": "203.0.113.7", "headers": {"X-API-Key": "k1"}, "cost": 2}"#,
        )
        .unwrap();
        assert_eq!(r.namespace.as_deref(), Some("tenant-acme"));
        assert_eq!(r.method, "POST");
        assert_eq!(r.client_ip, Some("203.0.113.7".parse().unwrap()));
        assert_eq!(r.headers.get("x-api-key").map(String::as_str), Some("k1"));
        assert_eq!(r.cost, Some(2));
    }

    #[test]
    fn header_names_are_canonical_and_each_header_is_stated_once() {
        let r = CheckRequest::from_json(br#"{"path": "/", "headers": {"X_API_KEY": "k1", "Accept": "a"}}"#).unwrap();
        assert_eq!(r.headers.get("x-api-key").map(String::as_str), Some("k1"), "what a WSGI app reads as the key");
        assert_eq!(r.headers.get("accept").map(String::as_str), Some("a"));
        for body in [
            r#"{"path": "/", "headers": {"x-api-key": "k1", "x_api_key": "k2"}}"#,
            r#"{"path": "/", "headers": {"X-API-Key": "k1", "x-api-key": "k2"}}"#,
        ] {
            assert!(err(body).starts_with("headers: ") && err(body).contains("are one header"), "{}", err(body));
        }
    }

    #[test]
    fn bad_input_is_named() {
        assert!(err("not json").contains("invalid JSON"));
        assert!(err("").contains("empty body"));
        assert!(err(r#"{"path": "/", "cost": -1}"#).starts_with("cost: "));
        assert!(err(r#"{"path": "/", "cost": 1.5}"#).starts_with("cost: "));
        assert!(err(r#"{"path": "/", "cost": 99999999999}"#).starts_with("cost: must be at most"));
        assert!(err(r#"{"path": "/", "clientIp": "300.1.1.1"}"#).starts_with("clientIp: "));
        assert!(err(r#"{"path": "/", "headers": {"x": 5}}"#).starts_with("headers.x: invalid type"));
        assert!(err(r#"{"path": "/", "headers": {"bad name": "v"}}"#).starts_with("headers: "));
        // Issue #37: the credential header is no header rules see, in any spelling.
        for body in [
            r#"{"path": "/", "headers": {"x-sluice-authorization": "Bearer t", "a": "1"}}"#,
            r#"{"path": "/", "headers": {"X_Sluice_Authorization": "Bearer t", "A": "1"}}"#,
        ] {
            let request = CheckRequest::from_json(body.as_bytes()).unwrap();
            assert_eq!(request.headers.keys().collect::<Vec<_>>(), ["a"], "{body}");
        }
        let long = format!(r#"{{"path": "/", "headers": {{"x-api-key": "{}"}}}}"#, "k".repeat(8193));
        assert!(err(&long).contains("header x-api-key: value longer than 8192 bytes"), "{}", err(&long));
        assert!(err(r#"{"path": "orders"}"#).starts_with("path: must start with '/'"));
        assert!(err(r#"{"path": "/", "clientIP": "1.2.3.4"}"#).contains("unknown field `clientIP`"));
        assert!(err(r#"{"path": "/", "labels": ["a"]}"#).starts_with("labels: invalid type"));
        assert!(err(r#"[1, 2]"#).contains("invalid type"));
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(!err(&format!(r#"{{"path": "/", "x": {deep}}}"#)).is_empty());
        assert!(err(&format!(r#"{{"path": "/", "labels": {{"a": {deep}}}}}"#)).starts_with("labels.a: "));
    }

    #[test]
    fn what_the_sidecar_sends_the_endpoint_reads_as_the_same_request() {
        let labels = BTreeMap::from([("app".to_string(), "orders".to_string())]);
        let input = CheckInput {
            namespace: "tenant-a",
            labels: &labels,
            method: "POST",
            path: "/orders/1?x=%2F",
            host: Some("api.example.com"),
            client_ip: "203.0.113.7".parse().unwrap(),
            headers: BTreeMap::from([("x-api-key".to_string(), "k1".to_string())]),
            request_fields: BTreeMap::from([
                ("max_tokens".to_string(), "1000".to_string()),
                ("not_digits".to_string(), "x".to_string()),
            ]),
            egress: Some("bank"),
            deadline_ms: Some(250),
            slot: None,
        };
        let sent = serde_json::to_vec(&input).unwrap();
        let read = CheckRequest::from_json(&sent).unwrap();
        assert_eq!(read.namespace.as_deref(), Some(input.namespace));
        assert_eq!(read.labels, labels);
        assert_eq!((read.method.as_str(), read.path.as_str()), (input.method, input.path));
        assert_eq!(read.host.as_deref(), input.host);
        assert_eq!(read.client_ip, Some(input.client_ip));
        assert_eq!(read.headers, input.headers);
        assert_eq!(read.cost, None, "the sidecar never states a cost");
        assert_eq!((read.egress.as_deref(), read.deadline_ms, read.wait), (Some("bank"), Some(250), false));
        assert_eq!(
            read.request_fields,
            BTreeMap::from([("max_tokens".to_string(), "1000".to_string())]),
            "integer fields travel as JSON integers; anything else is not sent"
        );
        let bare = CheckInput { host: None, headers: BTreeMap::new(), request_fields: BTreeMap::new(), ..input };
        let read = CheckRequest::from_json(&serde_json::to_vec(&bare).unwrap()).unwrap();
        assert_eq!((read.host, read.headers.len(), read.request_fields.len()), (None, 0, 0));
    }

    #[test]
    fn what_the_endpoint_answers_the_sidecar_reads() {
        let response = crate::engine::CheckResponse {
            allowed: false,
            status: 429,
            retry_after_ms: Some(250),
            delay_ms: 0,
            headers: vec![(std::borrow::Cow::Borrowed("retry-after"), "1".to_string())],
            body: Some("over quota".into()),
            rules: vec![],
            snapshot: "v7".into(),
            lease: Some("t.sig".into()),
            slot: Some("1f:99".into()),
        };
        let read: CheckAnswer = serde_json::from_slice(&serde_json::to_vec(&response).unwrap()).unwrap();
        assert_eq!((read.allowed, read.status, read.retry_after_ms), (Some(false), Some(429), Some(250)));
        assert_eq!(read.headers, [("retry-after".to_string(), "1".to_string())]);
        assert_eq!(
            (read.body.as_deref(), read.lease.as_deref(), read.error),
            (Some("over quota"), Some("t.sig"), None)
        );
    }
}
