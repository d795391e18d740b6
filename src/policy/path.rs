//! The path rules match and key on, the same for every entry point.
//!
//! Application servers do not agree on what a path names: WSGI decodes `%2F` in `PATH_INFO`,
//! Tomcat and Jetty drop `;jsessionid=…` parameters, IIS reads `\` as `/` and ignores a
//! segment's trailing dots, and every one of them routes `//orders/1`, `/%6Frders/1` and
//! `/x/../orders/1` to `/orders/1`. A limiter that matched the raw text would let a client step
//! around a `prefix: /orders` rule by spelling the path the way some server reads as `/orders`.
//! So where servers disagree, the path is read the way that limits: every spelling that some
//! common server routes to a resource is matched and keyed as that resource. An alternative
//! spelling can then only be limited more, never less. Before matching, the path (without its
//! query) is normalized in this order:
//!
//! 1. percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded, and so are
//!    `%2F` and `%5C` (to `/`); a `\` is a `/` too; other escapes keep their meaning and get
//!    upper-case hex digits (`%3b` → `%3B`: an encoded `;` is data); a `%` that starts no escape
//!    is a literal `%` (`%25`);
//! 2. the path is split into segments at `/`; repeated slashes give empty segments, which go;
//! 3. each segment loses its `;` parameters (`/orders;x=1/1` → `/orders/1`), before `.` and `..`
//!    are looked at, so `/x/..;/orders` ends at `/orders` as it does in Tomcat;
//! 4. each segment other than `.` and `..` loses its trailing dots (`/orders.` → `/orders`);
//! 5. `.` and `..` segments are removed (`..` above the root stays at the root), RFC 3986 §5.2.4.
//!
//! One spelling has two readings no normalization can reconcile: a dot segment next to an encoded
//! separator (`/orders/..%2F1`). A server that decodes `%2F` (WSGI) climbs out of `/orders`; one
//! that routes the raw path (most) serves `/orders/..%2F1` inside it. Reading it either way would
//! let it step around the rules of the other, so such a path is refused as malformed
//! ([`climbs_through_encoded_separator`]) by every entry point, before any rule is matched.
//!
//! A trailing slash is kept (`/orders/` and `/orders` may be different resources). Case is kept:
//! a rule opts in to ignoring it (`ignoreCase` on a path match), since folding it for every rule
//! would merge distinct resources of case-sensitive servers. What the application receives is
//! never altered: this is only how the limiter reads the path.

use std::borrow::Cow;

/// The normalized form of `path` (an origin-form path without query, or `*`); borrowed when
/// it is already normal, which is the common case.
pub fn normalize(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    Cow::Owned(rewrite(path))
}

/// Whether `path` holds a dot segment (`.` or `..`, however spelled) with an encoded separator
/// (`%2F`, `%5C`) on either side: a path that servers which decode separators and servers which
/// do not read as different resources (see the module docs). Legitimate clients never send one.
pub fn climbs_through_encoded_separator(path: &str) -> bool {
    let bytes = path.as_bytes();
    let lower = |b: u8| b.to_ascii_lowercase();
    // Where separators are: (start, end, encoded) of each, raw `/` and `\` or their escapes.
    let mut separators: Vec<(usize, usize, bool)> = vec![(0, 0, false)];
    let mut i = 0;
    while i < bytes.len() {
        if matches!(bytes[i], b'/' | b'\\') {
            separators.push((i, i + 1, false));
            i += 1;
        } else if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && (bytes[i + 1] == b'2' && lower(bytes[i + 2]) == b'f'
                || bytes[i + 1] == b'5' && lower(bytes[i + 2]) == b'c')
        {
            separators.push((i, i + 3, true));
            i += 3;
        } else {
            i += 1;
        }
    }
    separators.push((bytes.len(), bytes.len(), false));
    if !separators.iter().any(|&(_, _, encoded)| encoded) {
        return false;
    }
    separators.windows(2).any(|pair| {
        let ((_, start, before), (end, _, after)) = (pair[0], pair[1]);
        (before || after) && {
            let segment = decode(&path[start..end]);
            matches!(without_parameters(&segment), "." | "..")
        }
    })
}

fn rewrite(path: &str) -> String {
    let decoded = decode(path);
    let mut segments: Vec<&str> = Vec::new();
    // Whether the last segment names a directory: a path ending in `/`, `/.` or `/..` (once
    // parameters and dots are gone) keeps its trailing slash.
    let mut ends_in_directory = false;
    for raw in decoded.split('/') {
        let segment = without_trailing_dots(without_parameters(raw));
        ends_in_directory = matches!(segment, "" | "." | "..");
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
    if out.is_empty() || ends_in_directory {
        out.push('/');
    }
    out
}

/// Whether [`rewrite`] would return `path` unchanged: nothing to decode, no `\`, no parameters,
/// no empty segment but the last, no segment ending in a dot (which covers `.` and `..`).
fn is_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    if path == "*" || !bytes.starts_with(b"/") {
        return true;
    }
    if bytes.iter().any(|b| matches!(b, b'%' | b'\\' | b';')) {
        return false;
    }
    !bytes.windows(2).any(|w| w == b"//") && !path.split('/').any(|segment| segment.ends_with('.'))
}

/// `orders;jsessionid=1` → `orders`: what Tomcat and Jetty route on.
fn without_parameters(segment: &str) -> &str {
    segment.split_once(';').map_or(segment, |(name, _)| name)
}

/// `orders.` → `orders`, `...` → `` (IIS, after Windows file names); `.` and `..` stay dot
/// segments.
fn without_trailing_dots(segment: &str) -> &str {
    match segment {
        "." | ".." => segment,
        _ => segment.trim_end_matches('.'),
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Step 1 of the module docs: unreserved escapes decoded, every spelling of a separator (`\`,
/// `%2F`, `%5C`) made `/`, other escapes with upper-case hex.
fn decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            out.push('/');
            i += 1;
            continue;
        }
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            let value = hi * 16 + lo;
            if is_unreserved(value) {
                out.push(value as char);
            } else if matches!(value, b'/' | b'\\') {
                out.push('/');
            } else {
                out.push('%');
                out.push((bytes[i + 1] as char).to_ascii_uppercase());
                out.push((bytes[i + 2] as char).to_ascii_uppercase());
            }
            i += 3;
            continue;
        }
        if bytes[i] == b'%' {
            // Not an escape: a literal '%', as a server that decodes once reads it. Written as
            // one, so that what decoding produces next (`%2%46` → `%2` `F`) cannot form an
            // escape a second reading would decode.
            out.push_str("%25");
            i += 1;
            continue;
        }
        // `i` is on a character boundary (everything above steps over ASCII only), and so is the
        // next '%' or '\': copying up to it keeps UTF-8 intact. Searching from `i + 1` instead
        // cut a multi-byte character after an escape in two (found by scripts/fuzz.sh).
        let next = path[i..].find(['%', '\\']).map_or(bytes.len(), |at| i + at);
        out.push_str(&path[i..next]);
        i = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by scripts/fuzz.sh (path_normalize): a multi-byte character right after an escape
    /// or a `\` made the copy start inside it, a panic on every entry point's request path.
    #[test]
    fn multi_byte_characters_after_escapes_and_backslashes() {
        for input in ["/\\/\\\\\\\\\\\\\\х////\0.", "/%41é", "/a\\é", "/%zzé", "/%é"] {
            let once = normalize(input);
            assert_eq!(normalize(&once), once, "{input:?}");
        }
        assert_eq!(normalize("/%41é"), "/Aé");
        assert_eq!(normalize("/a\\é"), "/a/é");
    }
    use proptest::prelude::*;

    #[test]
    fn spellings_of_one_path_normalize_alike() {
        for variant in ["/orders/1", "//orders/1", "/%6Frders/1", "/%6frders/1", "/x/../orders/1", "/./orders//1"] {
            assert_eq!(normalize(variant), "/orders/1", "{variant}");
        }
        assert_eq!(normalize("/%2E%2E/orders"), "/orders", "encoded dots are dots");
        assert_eq!(normalize("/../../orders"), "/orders", "never above the root");
    }

    /// Each spelling some common server routes to `/orders/1` (or `/orders`), with the server.
    #[test]
    fn spellings_servers_disagree_on_are_read_the_way_that_limits() {
        for (variant, normal, who) in [
            ("/orders%2F1", "/orders/1", "WSGI decodes %2F in PATH_INFO"),
            ("/orders%2f1", "/orders/1", "lower-case hex"),
            ("/orders%5C1", "/orders/1", "IIS: an encoded backslash"),
            ("/orders\\1", "/orders/1", "IIS: backslash is a separator"),
            ("/\\orders\\1", "/orders/1", "IIS"),
            ("/orders;x=1/1", "/orders/1", "Tomcat, Jetty: path parameters"),
            ("/orders;jsessionid=ABC", "/orders", "Tomcat"),
            ("/orders/1;", "/orders/1", "an empty parameter"),
            ("/;x/orders/1", "/orders/1", "a segment of parameters only is empty"),
            ("/x/..;/orders/1", "/orders/1", "Tomcat: `..;` is `..`"),
            ("/x/.;y/orders/1", "/x/orders/1", "`.;y` is `.`"),
            ("/orders./1", "/orders/1", "IIS: trailing dots"),
            ("/orders../1..", "/orders/1", "IIS: several trailing dots"),
            ("/orders.;x/1", "/orders/1", "parameters, then dots"),
        ] {
            assert_eq!(normalize(variant), normal, "{variant}: {who}");
        }
    }

    /// Issue #37: `/orders/..%2F1` is `/1` to WSGI and `/orders/..%2F1` to a server routing the
    /// raw path; read either way, it steps around the other reading's rules.
    #[test]
    fn dot_segments_next_to_encoded_separators_are_ambiguous() {
        for climb in [
            "/orders/..%2F1",
            "/orders/x/..%2F..%2F7",
            "/reports/..%2F..%2Fevents",
            "/reports/..%2f..%2fcheckout",
            "/x/%2E%2E%2Forders/1",
            "/orders%2F..%2F..%2Forders/1",
            "/a%5C..%5Cb",
            "/a%2F.",
            "/a/.%2Fb",
            "/a/..;x%2Fb",
        ] {
            assert!(climbs_through_encoded_separator(climb), "{climb}");
        }
        for plain in ["/orders/1", "/orders%2F1", "/x/../orders", "/a/..b%2Fc", "/a%2F...", "/a%2F.b", "/%2", "/a%2"] {
            assert!(!climbs_through_encoded_separator(plain), "{plain}");
        }
    }

    #[test]
    fn what_stays() {
        assert!(matches!(normalize("/orders/1"), Cow::Borrowed(_)), "normal paths are not copied");
        assert!(matches!(normalize("/orders/1.json"), Cow::Borrowed(_)), "an inner dot is no trailing dot");
        assert_eq!(normalize("/orders/"), "/orders/", "trailing slash kept");
        assert_eq!(normalize("/orders/;x"), "/orders/", "a trailing parameter-only segment is a trailing slash");
        assert_eq!(normalize("/orders/..."), "/orders/", "a dots-only segment is empty");
        assert_eq!(normalize("/a/b/.."), "/a/");
        assert_eq!(normalize("/a%3bb"), "/a%3Bb", "an encoded `;` is data, not a parameter");
        assert_eq!(normalize("/a%252Fb"), "/a%252Fb", "decoded once, like every server");
        assert_eq!(normalize("/a%zz"), "/a%25zz", "a broken escape is a literal '%'");
        assert_eq!(normalize("/a%4"), "/a%254");
        assert_eq!(normalize("/a%2%46"), "/a%252F", "an escape decoding makes is not decoded again");
        assert_eq!(normalize("/caf%C3%A9/é"), "/caf%C3%A9/é");
        assert_eq!(normalize("/Orders"), "/Orders", "case is a rule's choice (ignoreCase)");
        assert_eq!(normalize("*"), "*");
        assert_eq!(normalize("/"), "/");
        assert_eq!(normalize("//"), "/");
        assert_eq!(normalize("/.."), "/");
        assert_eq!(normalize("/;"), "/");
    }

    proptest! {
        /// The borrowed fast path says "normal" only of paths the rewrite leaves alone, and
        /// normalizing is done once and for all.
        #[test]
        fn the_fast_path_agrees_and_normalizing_twice_changes_nothing(
            path in "/[/\\\\.;%=0-9A-Fa-fo]{0,16}"
        ) {
            if is_normal(&path) {
                prop_assert_eq!(rewrite(&path), path.clone());
            }
            let once = normalize(&path).into_owned();
            prop_assert_eq!(normalize(&once), once.clone());
        }
    }
}
