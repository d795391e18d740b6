//! What the sidecar decides and why it could not ask: the types the proxy, the decider, the
//! endpoint client and its batches all speak, kept apart from each of them so none imports
//! another for them.

use std::time::Duration;

use http::StatusCode;
use http::header::{HeaderName, HeaderValue};

pub type HeaderList = Vec<(HeaderName, HeaderValue)>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow {
        delay: Duration,
        headers: HeaderList,
        /// What the request holds (its concurrency rules' slots) until its response ends.
        lease: Option<Held>,
    },
    Deny {
        retry_after_secs: Option<u64>,
        /// The same, exact: when a replay of a deferred write may be checked again.
        retry_after_ms: Option<u64>,
        headers: HeaderList,
        /// The refusing rule's declared `refusal` (status and body) instead of the default 429.
        declared: Option<Declared>,
    },
    /// The request cannot be decided as sent: answered with a 4xx, never forwarded.
    Refuse(Refusal),
}

/// An admitted request's lease, and who holds it: the endpoint, or (while it was away) this
/// sidecar's local engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    Endpoint(String),
    Local(String),
}

/// Why a request is answered with a 4xx by the sidecar itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub detail: String,
}

impl Refusal {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Refusal {
        Refusal { status, detail: detail.into() }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint unreachable: {0}")]
    Unreachable(String),
    #[error("endpoint answered {0}")]
    Status(StatusCode),
    #[error("endpoint refused the check request ({0}): {1}")]
    Rejected(StatusCode, String),
    #[error("endpoint answer not understood: {0}")]
    Decode(String),
    #[error("endpoint did not answer within {0:?}")]
    Timeout(Duration),
}

impl EndpointError {
    pub fn kind(&self) -> &'static str {
        match self {
            EndpointError::Unreachable(_) => "unreachable",
            EndpointError::Status(_) => "status",
            EndpointError::Rejected(..) => "rejected",
            EndpointError::Decode(_) => "decode",
            EndpointError::Timeout(_) => "timeout",
        }
    }
}

/// A refusal declared by the policy: what the refused request gets instead of the default 429.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    pub status: http::StatusCode,
    pub body: bytes::Bytes,
}

/// What an engine or endpoint answer says about a request, as the sidecar acts on it: `status`
/// and `body` are the answer's (a status other than 429, or a body, is a declared refusal);
/// headers that are not valid HTTP are dropped rather than failing the request.
pub fn decision_of<'a>(
    allowed: bool,
    retry_after_ms: Option<u64>,
    delay_ms: u64,
    headers: impl Iterator<Item = (&'a str, &'a str)>,
    lease: Option<Held>,
    status: u16,
    body: Option<&str>,
) -> Decision {
    let headers = headers.filter_map(|(k, v)| Some((header_name(k)?, HeaderValue::from_str(v).ok()?))).collect();
    if allowed {
        return Decision::Allow { delay: Duration::from_millis(delay_ms), headers, lease };
    }
    let declared = (status != 429 || body.is_some())
        .then(|| http::StatusCode::from_u16(status).ok())
        .flatten()
        .map(|status| Declared { status, body: bytes::Bytes::from(body.unwrap_or("").to_string()) });
    Decision::Deny { retry_after_secs: retry_after_ms.map(|ms| ms.div_ceil(1000)), retry_after_ms, headers, declared }
}

/// The names the engine answers with, parsed once (a name outside the standard set is otherwise
/// parsed and copied for every request); any other valid name as sent.
fn header_name(name: &str) -> Option<HeaderName> {
    static KNOWN: std::sync::LazyLock<[HeaderName; 6]> = std::sync::LazyLock::new(|| {
        [
            HeaderName::from_static("ratelimit-policy"),
            HeaderName::from_static("ratelimit"),
            HeaderName::from_static("x-ratelimit-limit"),
            HeaderName::from_static("x-ratelimit-remaining"),
            HeaderName::from_static("x-ratelimit-reset"),
            http::header::RETRY_AFTER,
        ]
    });
    match KNOWN.iter().find(|known| known.as_str().eq_ignore_ascii_case(name)) {
        Some(known) => Some(known.clone()),
        None => HeaderName::from_bytes(name.as_bytes()).ok(),
    }
}

/// hyper-util's errors put the useful part (connection refused…) in the source chain.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
