//! Request header values as rules see them.
//!
//! A rule that keys on or matches a header must see exactly the value the application will
//! read. A header sent several times has no single value (joining the copies, or keeping the
//! first or the last, each lets a client pick its own bucket by adding a copy), so such a request
//! is refused when a rule uses that header. Values must be UTF-8; the endpoint's own credential
//! header is never visible to rules.

use http::HeaderMap;

use crate::policy::StrMap;

/// The caller's credential header: never part of what rules see.
const CREDENTIAL_HEADER: &str = crate::server::auth::AUTHORIZATION_HEADER;

/// A borrowed [`StrMap`] over an HTTP header map (names are case-insensitive there).
#[derive(Clone, Copy)]
pub struct HeaderLookup<'a>(pub &'a HeaderMap);

impl StrMap for HeaderLookup<'_> {
    fn get_str(&self, name: &str) -> Option<&str> {
        if name == CREDENTIAL_HEADER {
            return None;
        }
        self.0.get(name).and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
    }
}

/// Refuses headers in `used` (lowercase names the rules use) that appear more than once or whose
/// value is not UTF-8, naming the header.
pub fn check_used_headers(headers: &HeaderMap, used: &[String]) -> Result<(), String> {
    for name in used {
        let mut values = headers.get_all(name.as_str()).iter();
        let Some(first) = values.next() else { continue };
        if values.next().is_some() {
            return Err(format!("header {name}: sent more than once; a rate-limited header must have one value"));
        }
        if std::str::from_utf8(first.as_bytes()).is_err() {
            return Err(format!("header {name}: value is not UTF-8"));
        }
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
        assert!(check_used_headers(&h, &["x-api-key".into()]).unwrap_err().starts_with("header x-api-key"));
        assert!(check_used_headers(&h, &["accept-language".into()]).is_ok(), "unused duplicates are fine");
        h.insert("x-bin", HeaderValue::from_bytes(b"\xff").unwrap());
        assert!(check_used_headers(&h, &["x-bin".into()]).unwrap_err().contains("UTF-8"));
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
