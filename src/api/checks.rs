//! `POST /v1/checks`: many checks in one call, `{"requests": [check, …]}`, each check a
//! `POST /v1/check` body ([`super::check`]), answered in order.

use serde::{Deserialize, Serialize};

use super::check::CheckAnswer;

/// The body as the endpoint reads it: each check kept as its raw JSON, parsed on its own so that
/// one bad check is refused without failing the others.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchBody<'a> {
    #[serde(borrow)]
    pub requests: Vec<&'a serde_json::value::RawValue>,
}

/// The body as a client writes it, from checks already serialized (the sidecar serializes each
/// check once, when it is queued).
pub fn batch_body<'a>(checks: impl ExactSizeIterator<Item = &'a [u8]> + Clone) -> Vec<u8> {
    let mut body = Vec::with_capacity(16 + checks.clone().map(|c| c.len() + 1).sum::<usize>());
    body.extend_from_slice(b"{\"requests\":[");
    for (i, check) in checks.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(check);
    }
    body.extend_from_slice(b"]}");
    body
}

/// One answer of a batch: the decision without the per-rule detail (`POST /v1/check` has it),
/// or why this one check was refused.
#[derive(Serialize)]
#[serde(untagged)]
pub enum BatchResult<'a> {
    Decided(LeanDecision<'a>),
    Refused { status: u16, error: String },
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeanDecision<'a> {
    pub allowed: bool,
    pub status: u16,
    pub retry_after_ms: Option<u64>,
    pub delay_ms: u64,
    #[serde(serialize_with = "crate::engine::ordered_map")]
    pub headers: &'a [(std::borrow::Cow<'static, str>, String)],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<&'a str>,
    pub snapshot: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<&'a str>,
}

/// The answer as the endpoint writes it: `{"results": [result, …]}`, in the checks' order.
#[derive(Serialize)]
pub struct BatchResults<'a> {
    pub results: &'a [BatchResult<'a>],
}

impl LeanDecision<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        let decision = crate::engine::json::Decision {
            allowed: self.allowed,
            status: self.status,
            retry_after_ms: self.retry_after_ms,
            delay_ms: self.delay_ms,
            headers: self.headers,
            body: self.body,
            rules: None,
            snapshot: self.snapshot,
            lease: self.lease,
            slot: self.slot,
        };
        crate::engine::json::write_decision(out, &decision);
    }
}

impl BatchResults<'_> {
    /// Appends the answer's JSON to `out`: exactly `serde_json::to_writer(out, self)`, with each
    /// decision written by hand (`engine::json`: serde_json's escaping of every key was a tenth
    /// of a check's instructions).
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"results\":[");
        for (i, result) in self.results.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            match result {
                BatchResult::Decided(decision) => decision.write_json(out),
                // Rare, and a message to escape: serde_json writes it.
                BatchResult::Refused { .. } => {
                    if serde_json::to_writer(&mut *out, result).is_err() {
                        out.extend_from_slice(b"null");
                    }
                }
            }
        }
        out.extend_from_slice(b"]}");
    }
}

/// The answer as a client reads it: each result a [`CheckAnswer`].
#[derive(Deserialize)]
pub struct BatchAnswer {
    pub results: Vec<CheckAnswer>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::check::CheckRequest;

    #[test]
    fn what_a_client_batches_the_endpoint_reads_check_by_check() {
        let checks: Vec<Vec<u8>> = vec![br#"{"path": "/a"}"#.to_vec(), br#"{"path": "/b", "method": "post"}"#.to_vec()];
        let body = batch_body(checks.iter().map(Vec::as_slice));
        let read: BatchBody<'_> = serde_json::from_slice(&body).unwrap();
        let requests: Vec<CheckRequest> =
            read.requests.iter().map(|raw| CheckRequest::from_json(raw.get().as_bytes()).unwrap()).collect();
        assert_eq!(
            requests.iter().map(|r| (r.path.as_str(), r.method.as_str())).collect::<Vec<_>>(),
            [("/a", "GET"), ("/b", "POST")]
        );
        let empty = batch_body(std::iter::empty());
        assert!(serde_json::from_slice::<BatchBody<'_>>(&empty).unwrap().requests.is_empty());
    }

    #[test]
    fn what_the_endpoint_answers_a_client_reads_result_by_result() {
        let headers = vec![(std::borrow::Cow::Borrowed("ratelimit"), "limit=10, remaining=0".to_string())];
        let results = [
            BatchResult::Decided(LeanDecision {
                allowed: false,
                status: 429,
                retry_after_ms: Some(1500),
                delay_ms: 0,
                headers: &headers,
                body: Some("slow down"),
                snapshot: "v1",
                lease: None,
                slot: None,
            }),
            BatchResult::Decided(LeanDecision {
                allowed: true,
                status: 200,
                retry_after_ms: None,
                delay_ms: 20,
                headers: &[],
                body: None,
                snapshot: "v1",
                lease: Some("t.sig"),
                slot: None,
            }),
            BatchResult::Refused { status: 400, error: "path: must start with '/'".into() },
        ];
        let sent = serde_json::to_vec(&BatchResults { results: &results }).unwrap();
        let read: BatchAnswer = serde_json::from_slice(&sent).unwrap();
        let [refused, admitted, bad] = &read.results[..] else { panic!("{} results", read.results.len()) };
        assert_eq!((refused.allowed, refused.status, refused.retry_after_ms), (Some(false), Some(429), Some(1500)));
        assert_eq!(refused.headers, [("ratelimit".to_string(), "limit=10, remaining=0".to_string())]);
        assert_eq!(refused.body.as_deref(), Some("slow down"));
        assert_eq!((admitted.allowed, admitted.delay_ms, admitted.lease.as_deref()), (Some(true), 20, Some("t.sig")));
        assert_eq!(
            (bad.allowed, bad.status, bad.error.as_deref()),
            (None, Some(400), Some("path: must start with '/'"))
        );
    }

    #[test]
    fn the_batch_answer_is_what_serde_json_writes() {
        use std::borrow::Cow;
        let headers = vec![
            (Cow::Borrowed("RateLimit-Policy"), "\"ns/p\";q=10;w=1".to_string()),
            (Cow::Owned("x-declared".to_string()), "a\\b\n".to_string()),
        ];
        let decided = |lease: Option<&'static str>, body: Option<&'static str>| {
            BatchResult::Decided(LeanDecision {
                allowed: lease.is_some(),
                status: 429,
                retry_after_ms: body.map(|_| 1500),
                delay_ms: 7,
                headers: &headers,
                body,
                snapshot: "v1",
                lease,
                slot: lease.map(|_| "1f:2000"),
            })
        };
        let results = [
            decided(Some("token.sig"), None),
            BatchResult::Refused { status: 400, error: "bad \"path\"".to_string() },
            decided(None, Some("{\"busy\": true}")),
        ];
        for results in [&results[..], &results[..0]] {
            let batch = BatchResults { results };
            let mut written = Vec::new();
            batch.write_json(&mut written);
            assert_eq!(String::from_utf8(written).unwrap(), serde_json::to_string(&batch).unwrap());
        }
    }
}
