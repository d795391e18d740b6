//! The host rules see, and the requests whose host is ambiguous.
//!
//! RFC 9112 §3.2: a server MUST answer 400 to a request with more than one Host field line, or
//! with an invalid one. Such a request has no single host: the limiter would read one copy and
//! the application, or a proxy in front of it, perhaps another. So every entry point that reads
//! Host from the request refuses it instead of picking. A request target in absolute form
//! (`GET http://a.example/ HTTP/1.1`), or HTTP/2's `:authority`, names the host too; a Host that
//! names another one is refused as well (RFC 9113 §8.3.1 calls it malformed for HTTP/2), since
//! servers disagree on which of the two wins.

use std::str::FromStr;

use http::HeaderMap;
use http::header::HOST;
use http::uri::Authority;

/// Why a request's host cannot be decided on (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostProblem {
    #[error("more than one Host header: a request names one host (RFC 9112 §3.2)")]
    Repeated,
    #[error("Host {0:?} is not a host name or address with an optional port (RFC 9112 §3.2)")]
    Invalid(String),
    #[error("Host {host:?} differs from {target:?}, the host the request target names")]
    DiffersFromTarget { host: String, target: String },
}

/// The request's host as sent: its Host header, else the request target's authority (absolute
/// form, HTTP/2 `:authority`), else `None`. `target` is that authority when the entry point sees
/// the client's own request target.
pub fn request_host<'a>(headers: &'a HeaderMap, target: Option<&'a Authority>) -> Result<Option<&'a str>, HostProblem> {
    let mut values = headers.get_all(HOST).iter();
    let Some(value) = values.next() else {
        // A target's authority may carry a user part (`user@host`): a host never does, and which
        // part the application would read as its host is anyone's guess (found by scripts/fuzz.sh).
        return match target {
            Some(target) if target.as_str().contains('@') => Err(HostProblem::Invalid(target.as_str().to_string())),
            _ => Ok(target.map(Authority::as_str)),
        };
    };
    if values.next().is_some() {
        return Err(HostProblem::Repeated);
    }
    let invalid = || HostProblem::Invalid(String::from_utf8_lossy(value.as_bytes()).into_owned());
    let host = value.to_str().map_err(|_| invalid())?;
    // Empty is allowed: the target URI has no authority. A Host is never `user@host`.
    if !host.is_empty() && (Authority::from_str(host).is_err() || host.contains('@')) {
        return Err(invalid());
    }
    match target {
        Some(target) if !target.as_str().eq_ignore_ascii_case(host) => {
            Err(HostProblem::DiffersFromTarget { host: host.to_string(), target: target.as_str().to_string() })
        }
        _ => Ok(Some(host)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_hosts(hosts: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for host in hosts {
            headers.append(HOST, HeaderValue::from_static(host));
        }
        headers
    }

    #[test]
    fn one_valid_host_is_the_host() {
        assert_eq!(request_host(&with_hosts(&["api.example.com:8443"]), None), Ok(Some("api.example.com:8443")));
        assert_eq!(request_host(&with_hosts(&["[::1]:80"]), None), Ok(Some("[::1]:80")));
        assert_eq!(request_host(&with_hosts(&[""]), None), Ok(Some("")), "allowed when the target has no authority");
        assert_eq!(request_host(&with_hosts(&[]), None), Ok(None));
        let with_user = Authority::from_static("user@api.example.com");
        assert!(matches!(request_host(&with_hosts(&[]), Some(&with_user)), Err(HostProblem::Invalid(_))));
        let target = Authority::from_static("api.example.com");
        assert_eq!(request_host(&with_hosts(&[]), Some(&target)), Ok(Some("api.example.com")));
        assert_eq!(request_host(&with_hosts(&["API.example.com"]), Some(&target)), Ok(Some("API.example.com")));
    }

    #[test]
    fn ambiguous_hosts_are_refused() {
        assert_eq!(request_host(&with_hosts(&["a.example", "b.example"]), None), Err(HostProblem::Repeated));
        assert_eq!(request_host(&with_hosts(&["a.example", "a.example"]), None), Err(HostProblem::Repeated));
        for invalid in ["a.example, b.example", "user@a.example", "a.example/path", "a example"] {
            assert_eq!(
                request_host(&with_hosts(&[invalid]), None),
                Err(HostProblem::Invalid(invalid.to_string())),
                "{invalid}"
            );
        }
        let target = Authority::from_static("a.example");
        assert!(matches!(
            request_host(&with_hosts(&["b.example"]), Some(&target)),
            Err(HostProblem::DiffersFromTarget { .. })
        ));
        assert!(
            request_host(&with_hosts(&["b.example"]), Some(&target)).unwrap_err().to_string().contains("b.example")
        );
    }
}
