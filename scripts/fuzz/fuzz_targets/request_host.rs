//! The Host a request names (the sidecar and ext_authz): any set of Host values and request
//! target is one host, none, or a refusal; never a panic.
#![no_main]

use http::HeaderMap;
use http::header::{HOST, HeaderValue};
use http::uri::Authority;
use libfuzzer_sys::fuzz_target;
use sluice::request::host::request_host;

fuzz_target!(|input: (Vec<Vec<u8>>, Option<String>)| {
    let (hosts, target) = input;
    let mut headers = HeaderMap::new();
    for value in hosts.iter().take(4) {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(HOST, value);
        }
    }
    let authority = target.as_deref().and_then(|t| t.parse::<Authority>().ok());
    // An empty Host is allowed (a target without authority); any other is a valid authority
    // with no user part.
    if let Ok(Some(host)) = request_host(&headers, authority.as_ref()) {
        assert!(host.is_empty() || (host.parse::<Authority>().is_ok() && !host.contains('@')), "{host:?}");
    }
});
