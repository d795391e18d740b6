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
//! - `_` and `-` are one character in a header name, as they are to CGI and WSGI servers (PHP,
//!   Django, Flask, Rack…), which read `X-API-Key` and `X_API_KEY` both as `HTTP_X_API_KEY`: a
//!   rule on `x-api-key` sees a value sent as `X_API_KEY` — otherwise a client could get a fresh
//!   bucket by spelling the name with underscores (see
//!   [`canonical_header_name`](super::names::canonical_header_name));
//! - a header sent several times, under one spelling or several, has no single value (joining
//!   the copies, or keeping the first or the last, each lets a client pick its own bucket by
//!   adding a copy), so such a request is refused when a rule uses that header;
//! - values must be UTF-8;
//! - the endpoint's own credential header is never visible to rules.

use http::HeaderMap;
use http::header::{self, HeaderName, HeaderValue};

use super::names::{HOP_BY_HOP, StrMap, same_header_name};

/// The header carrying the caller's credential to the endpoint (see `server::auth`): never part
/// of what rules see.
pub const CREDENTIAL_HEADER: &str = "x-sluice-authorization";

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

/// The copies of header `name` (canonical, see
/// [`canonical_header_name`](super::names::canonical_header_name)) the application receives,
/// under any spelling, with the name each was sent as: hop-by-hop copies left out (a proxy
/// removes them by their exact name), and nothing for the credential header.
fn received<'a>(headers: &'a HeaderMap, name: &str) -> impl Iterator<Item = (&'a str, &'a HeaderValue)> {
    let visible = !same_header_name(name, CREDENTIAL_HEADER);
    headers
        .iter()
        .map(|(sent, value)| (sent.as_str(), value))
        .filter(move |(sent, _)| visible && same_header_name(sent, name) && !is_hop_by_hop(headers, sent))
}

/// The value rules see for header `name` (canonical): the one copy the application receives,
/// under whichever spelling it was sent; `None` when there is none, or the value is not UTF-8.
/// Requests with several copies are refused first ([`check_used_headers`]); should one get
/// here, the first copy is taken.
pub fn used_header_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    received(headers, name).next().and_then(|(_, value)| std::str::from_utf8(value.as_bytes()).ok())
}

/// A borrowed [`StrMap`] over an HTTP header map (names are case-insensitive there, and `_` is
/// `-`), showing what the application would receive: no hop-by-hop headers, no credential.
#[derive(Clone, Copy)]
pub struct HeaderLookup<'a>(pub &'a HeaderMap);

impl StrMap for HeaderLookup<'_> {
    fn get_str(&self, name: &str) -> Option<&str> {
        used_header_value(self.0, name)
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

/// Refuses headers in `used` (canonical names the rules use) that appear more than once, under
/// one spelling or several, whose value is not UTF-8 or longer than [`MAX_USED_HEADER_BYTES`],
/// naming the header. Hop-by-hop headers are not looked at: rules never see them.
pub fn check_used_headers(headers: &HeaderMap, used: &[String]) -> Result<(), UsedHeaderProblem> {
    for name in used {
        let mut values = received(headers, name);
        let Some((first_name, first)) = values.next() else { continue };
        if let Some((second_name, _)) = values.next() {
            // Named in a fixed order: a header map's order can change when a proxy removes an
            // entry, and the same request must be refused with the same words.
            let (first_name, second_name) =
                if first_name <= second_name { (first_name, second_name) } else { (second_name, first_name) };
            return Err(UsedHeaderProblem::Malformed(if first_name == second_name {
                format!("header {name}: sent more than once; a rate-limited header must have one value")
            } else {
                format!(
                    "header {name}: sent as both {first_name} and {second_name}, which CGI and WSGI servers read as \
                     one header; a rate-limited header must have one value"
                )
            }));
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

    /// Found by the sidecar_request_head fuzz target: removing a hop-by-hop header reorders a
    /// header map, and the refusal named the two spellings in the new order.
    #[test]
    fn two_spellings_are_refused_in_the_same_words_whatever_their_order() {
        let mut dash_first = HeaderMap::new();
        dash_first.append("x-api-key", HeaderValue::from_static("k1"));
        dash_first.append("x_api_key", HeaderValue::from_static("k2"));
        let mut underscore_first = HeaderMap::new();
        underscore_first.append("x_api_key", HeaderValue::from_static("k2"));
        underscore_first.append("x-api-key", HeaderValue::from_static("k1"));
        let used = ["x-api-key".to_string()];
        assert_eq!(check_used_headers(&dash_first, &used), check_used_headers(&underscore_first, &used));
    }

    #[test]
    fn underscore_and_dash_spell_one_header() {
        let mut h = HeaderMap::new();
        h.append("x_api_key", HeaderValue::from_static("k1"));
        assert_eq!(HeaderLookup(&h).get_str("x-api-key"), Some("k1"), "what a WSGI app reads as X-API-Key");
        assert!(check_used_headers(&h, &["x-api-key".into()]).is_ok());
        h.append("X-Api-Key", HeaderValue::from_static("k2"));
        let problem = check_used_headers(&h, &["x-api-key".into()]).unwrap_err().to_string();
        assert!(problem.contains("sent as both x-api-key and x_api_key"), "{problem}");
        assert!(check_used_headers(&h, &["x-other".into()]).is_ok(), "unused, so not looked at");

        // A proxy removes a hop-by-hop header by its exact name: the other spelling still reaches
        // the application, so the rule sees it.
        let mut h = HeaderMap::new();
        h.append("x_api_key", HeaderValue::from_static("k1"));
        h.append("x-api-key", HeaderValue::from_static("k2"));
        h.append("connection", HeaderValue::from_static("x-api-key"));
        assert!(check_used_headers(&h, &["x-api-key".into()]).is_ok());
        assert_eq!(HeaderLookup(&h).get_str("x-api-key"), Some("k1"));
        let mut forwarded = h.clone();
        strip_hop_by_hop(&mut forwarded, false);
        assert_eq!(forwarded.get("x_api_key").map(HeaderValue::as_bytes), Some(&b"k1"[..]));

        let mut h = HeaderMap::new();
        h.append("x_sluice_authorization", HeaderValue::from_static("Bearer t"));
        assert_eq!(HeaderLookup(&h).get_str(CREDENTIAL_HEADER), None, "the credential in any spelling");
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
