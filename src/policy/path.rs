//! The path rules match and key on, the same for every entry point.
//!
//! Application servers route `//orders/1`, `/%6Frders/1` and `/x/../orders/1` to `/orders/1`; a
//! limiter that matched the raw text would let a client step around a `prefix: /orders` rule by
//! spelling the path differently. So before matching, the path (without its query) is
//! normalized as RFC 3986 §6.2.2 describes:
//!
//! 1. percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded; other escapes
//!    keep their meaning and get upper-case hex digits (`%2f` → `%2F`: an encoded slash stays
//!    encoded, since servers disagree about it);
//! 2. repeated slashes collapse into one;
//! 3. `.` and `..` segments are removed (`..` above the root stays at the root).
//!
//! A trailing slash is kept (`/orders/` and `/orders` may be different resources).

use std::borrow::Cow;

/// The normalized form of `path` (an origin-form path without query, or `*`); borrowed when
/// it is already normal, which is the common case.
pub fn normalize(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let trailing_slash = decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Cow::Owned(out)
}

fn is_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    if path == "*" || !bytes.starts_with(b"/") {
        return true;
    }
    if bytes.contains(&b'%') {
        return false;
    }
    // No empty, `.` or `..` segment: every '/' is followed by a byte that starts a real segment.
    !bytes.windows(2).any(|w| w == b"//") && !path.split('/').skip(1).any(|segment| segment == "." || segment == "..")
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            let value = hi * 16 + lo;
            if is_unreserved(value) {
                out.push(value as char);
            } else {
                out.push('%');
                out.push((bytes[i + 1] as char).to_ascii_uppercase());
                out.push((bytes[i + 2] as char).to_ascii_uppercase());
            }
            i += 3;
            continue;
        }
        // `path` is a str and '%' is ASCII: copying up to the next '%' keeps UTF-8 intact.
        let next = path[i + 1..].find('%').map_or(bytes.len(), |at| i + 1 + at);
        out.push_str(&path[i..next]);
        i = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_of_one_path_normalize_alike() {
        for variant in ["/orders/1", "//orders/1", "/%6Frders/1", "/%6frders/1", "/x/../orders/1", "/./orders//1"] {
            assert_eq!(normalize(variant), "/orders/1", "{variant}");
        }
        assert_eq!(normalize("/%2E%2E/orders"), "/orders", "encoded dots are dots");
        assert_eq!(normalize("/../../orders"), "/orders", "never above the root");
    }

    #[test]
    fn what_stays() {
        assert!(matches!(normalize("/orders/1"), Cow::Borrowed(_)), "normal paths are not copied");
        assert_eq!(normalize("/orders/"), "/orders/", "trailing slash kept");
        assert_eq!(normalize("/a/b/.."), "/a/");
        assert_eq!(normalize("/a%2fb"), "/a%2Fb", "an encoded slash stays encoded");
        assert_eq!(normalize("/a%zz"), "/a%zz", "a broken escape is left alone");
        assert_eq!(normalize("/a%4"), "/a%4");
        assert_eq!(normalize("/caf%C3%A9/é"), "/caf%C3%A9/é");
        assert_eq!(normalize("*"), "*");
        assert_eq!(normalize("/"), "/");
        assert_eq!(normalize("//"), "/");
        assert_eq!(normalize("/.."), "/");
    }
}
