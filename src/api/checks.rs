//! `POST /v1/checks`: many checks in one call, `{"requests": [check, …]}`, each check a
//! `POST /v1/check` body ([`super::check`]), answered in order.

use serde::Deserialize;

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
}
