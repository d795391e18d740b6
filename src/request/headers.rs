//! Request header values as rules see them.
//!
//! A rule that keys on or matches a header must see exactly the value the application will
//! read:
//!
//! - hop-by-hop headers (RFC 9110 §7.6.1: `Connection` and every header it names, `Keep-Alive`,
//!   `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, `HTTP2-Settings`, …) describe one connection
//!   and never reach the application, so rules never see them either — otherwise a client could
//!   send `X-API-Key: <random>` with `Connection: x-api-key` and be keyed on a value the
//!   application never receives;
//! - a header sent several times has no single value (joining the copies, or keeping the first
//!   or the last, each lets a client pick its own bucket by adding a copy), so such a request is
//!   refused when a rule uses that header;
//! - values must be UTF-8;
//! - the endpoint's own credential header is never visible to rules.

use http::HeaderMap;
use http::header::{self, HeaderName, HeaderValue};

use crate::policy::StrMap;

/// The header carrying the caller's credential to the endpoint (see `server::auth`): never part
/// of what rules see.
pub const CREDENTIAL_HEADER: &str = "x-sluice-authorization";

/// Connection-level headers, whatever `Connection` says.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "proxy-authenticate",
];

/// Whether `name` (lowercase) is hop-by-hop in a request with these headers.
pub fn is_hop_by_hop(headers: &HeaderMap, name: &str) -> bool {
    HOP_BY_HOP.contains(&name) || connection_tokens(headers).any(|token| token.eq_ignore_ascii_case(name))
}

fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Removes the hop-by-hop headers, as a proxy must before forwarding. An upgrade the proxy
/// carries through keeps `Upgrade` and gets `Connection: upgrade`, exactly what must reach the
/// application.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let listed: Vec<HeaderName> =
        connection_tokens(headers).filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok()).collect();
    for name in listed {
        if !(keep_upgrade && name == header::UPGRADE) {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP {
        if !(keep_upgrade && name == "upgrade") {
            headers.remove(name);
        }
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// A borrowed [`StrMap`] over an HTTP header map (names are case-insensitive there), showing what
/// the application would receive: no hop-by-hop headers, no credential.
#[derive(Clone, Copy)]
pub struct HeaderLookup<'a>(pub &'a HeaderMap);

impl StrMap for HeaderLookup<'_> {
    fn get_str(&self, name: &str) -> Option<&str> {
        if name == CREDENTIAL_HEADER || is_hop_by_hop(self.0, name) {
            return None;
        }
        self.0.get(name).and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
    }
}

/// The longest value of a header a rule uses (as for a path, `MAX_PATH_LEN`): rules match and
/// key on at most this much, so a regex's matching time is bounded by its compiled size times
/// this length, not by what a client chooses to send.
pub const MAX_USED_HEADER_BYTES: usize = 8192;

/// Refuses a value of a header a rule uses that is longer than [`MAX_USED_HEADER_BYTES`].
pub fn check_used_header_length(name: &str, value: &[u8]) -> Result<(), String> {
    if value.len() > MAX_USED_HEADER_BYTES {
        return Err(format!("header {name}: value longer than {MAX_USED_HEADER_BYTES} bytes"));
    }
    Ok(())
}

/// Why the headers a rule uses cannot be decided on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsedHeaderProblem {
    /// Sent twice, or not UTF-8.
    Malformed(String),
    /// Longer than [`MAX_USED_HEADER_BYTES`] (431 for a proxy).
    TooLarge(String),
}

impl std::fmt::Display for UsedHeaderProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UsedHeaderProblem::Malformed(m) | UsedHeaderProblem::TooLarge(m) => f.write_str(m),
        }
    }
}

/// Refuses headers in `used` (lowercase names the rules use) that appear more than once, whose
/// value is not UTF-8 or longer than [`MAX_USED_HEADER_BYTES`], naming the header. Hop-by-hop
/// headers are not looked at: rules never see them.
pub fn check_used_headers(headers: &HeaderMap, used: &[String]) -> Result<(), UsedHeaderProblem> {
    for name in used.iter().filter(|name| !is_hop_by_hop(headers, name)) {
        let mut values = headers.get_all(name.as_str()).iter();
        let Some(first) = values.next() else { continue };
        if values.next().is_some() {
            return Err(UsedHeaderProblem::Malformed(format!(
                "header {name}: sent more than once; a rate-limited header must have one value"
            )));
        }
        if std::str::from_utf8(first.as_bytes()).is_err() {
            return Err(UsedHeaderProblem::Malformed(format!("header {name}: value is not UTF-8")));
        }
        check_used_header_length(name, first.as_bytes()).map_err(UsedHeaderProblem::TooLarge)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn duplicates_of_used_headers_are_refused() {
        let mut h = HeaderMap::new();
        h.append("x-api-key", HeaderValue::from_static("k1"));
        h.append("x-api-key", HeaderValue::from_static("k2"));
        h.append("accept", HeaderValue::from_static("a"));
        h.append("accept", HeaderValue::from_static("b"));
        assert!(check_used_headers(&h, &["x-api-key".into()]).unwrap_err().to_string().starts_with("header x-api-key"));
        assert!(check_used_headers(&h, &["accept-language".into()]).is_ok(), "unused duplicates are fine");
        h.insert("x-bin", HeaderValue::from_bytes(b"\xff").unwrap());
        assert!(check_used_headers(&h, &["x-bin".into()]).unwrap_err().to_string().contains("UTF-8"));
        h.insert("x-long", HeaderValue::from_str(&"a".repeat(MAX_USED_HEADER_BYTES + 1)).unwrap());
        assert!(matches!(
            check_used_headers(&h, &["x-long".into()]),
            Err(UsedHeaderProblem::TooLarge(m)) if m.contains("longer than 8192 bytes")
        ));
        h.insert("x-long", HeaderValue::from_str(&"a".repeat(MAX_USED_HEADER_BYTES)).unwrap());
        assert!(check_used_headers(&h, &["x-long".into()]).is_ok());
    }

    #[test]
    fn hop_by_hop_headers_are_invisible_and_stripped() {
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("random"));
        h.insert("connection", HeaderValue::from_static("keep-alive, X-Api-Key"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert("http2-settings", HeaderValue::from_static("AAMAAABkAAQAoAAAAAIAAAAA"));
        h.insert("x-other", HeaderValue::from_static("kept"));
        assert_eq!(HeaderLookup(&h).get_str("x-api-key"), None, "named by Connection");
        assert_eq!(HeaderLookup(&h).get_str("upgrade"), None);
        assert!(check_used_headers(&h, &["x-api-key".into()]).is_ok());
        let mut forwarded = h.clone();
        strip_hop_by_hop(&mut forwarded, false);
        let names: Vec<_> = forwarded.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-other"]);
        let mut upgrade = HeaderMap::new();
        upgrade.insert("upgrade", HeaderValue::from_static("websocket"));
        upgrade.insert("connection", HeaderValue::from_static("Upgrade"));
        strip_hop_by_hop(&mut upgrade, true);
        assert_eq!(
            (upgrade["upgrade"].to_str().unwrap(), upgrade["connection"].to_str().unwrap()),
            ("websocket", "upgrade")
        );
    }

    #[test]
    fn the_credential_is_never_visible() {
        let mut h = HeaderMap::new();
        h.insert(CREDENTIAL_HEADER, HeaderValue::from_static("Bearer t"));
        h.insert("X-Api-Key", HeaderValue::from_static("k1"));
        assert_eq!(HeaderLookup(&h).get_str(CREDENTIAL_HEADER), None);
        assert_eq!(HeaderLookup(&h).get_str("x-api-key"), Some("k1"));
    }
}
