//! Redis URLs where credentials go: putting a password from a file into one
//! ([`with_credentials`]) and taking it out of anything logged or shown ([`redact_url`]), on one
//! reading of the authority ([`UrlParts`]).

/// `scheme://user:secret@host/…` → `scheme://user:***@host/…`; URLs without a password are
/// returned as they are.
pub fn redact_url(url: &str) -> String {
    let Some(parts) = UrlParts::of(url) else {
        // No scheme (a mistake refused at start-up): what precedes an `@` may still be a password.
        return match url.rfind('@') {
            Some(at) => format!("***@{}", &url[at + 1..]),
            None => url.to_string(),
        };
    };
    let Some(userinfo) = parts.userinfo else { return url.to_string() };
    let redacted = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        // `redis://secret@host` puts the password where a user would be.
        None => "***".to_string(),
    };
    format!("{}{redacted}@{}", parts.scheme, parts.after_userinfo)
}

/// `scheme://[userinfo@]host…` split where credentials go: the one reading of a Redis URL's
/// authority for putting a password in ([`with_credentials`]) and taking it out ([`redact_url`]).
pub struct UrlParts<'a> {
    /// Up to and including `://`.
    pub scheme: &'a str,
    pub userinfo: Option<&'a str>,
    /// The host and everything after it.
    pub after_userinfo: &'a str,
}

impl<'a> UrlParts<'a> {
    pub fn of(url: &'a str) -> Option<UrlParts<'a>> {
        let scheme_end = url.find("://")? + 3;
        let rest = &url[scheme_end..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (userinfo, after_userinfo) = match rest[..authority_end].rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        Some(UrlParts { scheme: &url[..scheme_end], userinfo, after_userinfo })
    }
}

/// Puts `user` and `password` into `url` where it names none: a URL with a password keeps its
/// credentials; a URL naming only its user (`redis://sluice@host`) gets the password.
pub fn with_credentials(url: &str, user: Option<&str>, password: Option<&str>) -> String {
    let Some(parts) = UrlParts::of(url) else { return url.to_string() };
    let (user, password) = match parts.userinfo {
        Some(userinfo) if userinfo.contains(':') => return url.to_string(),
        Some(named) => (Some(named.to_string()), password),
        None => (user.map(percent_encode), password),
    };
    let userinfo = match (user, password) {
        (None, None) => return url.to_string(),
        (Some(user), None) => user,
        (user, Some(password)) => format!("{}:{}", user.unwrap_or_default(), percent_encode(password)),
    };
    format!("{}{userinfo}@{}", parts.scheme, parts.after_userinfo)
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
