//! The head of a request the sidecar receives (method, target, version, headers, TCP peer,
//! `--trusted-hops`), through what `sidecar::proxy::Proxy::handle` does with it before and after
//! asking about it: hop-by-hop headers stripped (`request::headers::strip_hop_by_hop`), the
//! target checked (`api::check::check_path`), the client named
//! (`request::forwarded::client_ip`), the Host decided (`request::host::request_host`), the
//! headers the namespace's rules use checked and collected (`check_used_headers`,
//! `used_header_value`, `MAX_CHECK_HEADER_BYTES`), the `CheckInput` built, and the application's
//! X-Forwarded-* set (`set_forwarded`). `Proxy::handle` itself takes a hyper `Incoming` body and
//! a `Decider` that fetches its snapshot from an endpoint, so the steps are driven one by one,
//! in its order, with the example policies as the snapshot.
//!
//! Besides "no panic": stripping hop-by-hop headers changes no value or refusal rules see, and
//! stripping twice is stripping once; the client is a canonical address, the peer itself with
//! no trusted hops; keys are bounded and the path's normalization is idempotent; the check the
//! sidecar sends is one the endpoint takes (`CheckRequest::from_json`) and resolves to the same
//! rules, keys, costs, overload class and exemption as the sidecar's local fallback; and the
//! application, trusting the sidecar as one more hop, names the client the limiter keyed on.
#![no_main]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Request, Version};
use libfuzzer_sys::fuzz_target;
use sluice::policy::path::normalize;
use sluice::policy::{Matched, RequestView, Snapshot, compile, load_str};
use sluice::request::names::canonical_header_name;
use sluice::request::forwarded::{X_FORWARDED_PROTO, client_ip, set_forwarded};
use sluice::request::headers::{check_used_headers, strip_hop_by_hop, used_header_value};
use sluice::request::host::request_host;
use sluice::rule::MAX_INLINE_KEY;
use sluice::server::auth::Caller;
use sluice::api::check::{CheckInput, CheckRequest, check_path};
use sluice::sidecar::decide::MAX_CHECK_HEADER_BYTES;
use sluice::sidecar::proxy::is_websocket_upgrade;

const NAMESPACE: &str = "tenant-acme";

/// Rules on what the sidecar reads from a head: host, method, path, client IP, headers under
/// either spelling, the credential header (never visible), and overload priorities.
const EXTRA: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: sidecar-fuzz, namespace: tenant-acme}
spec:
  priorities:
    - {class: critical, match: {methods: [POST], paths: [{prefix: /checkout}]}}
    - {class: sheddable, match: {hosts: ["*.example.com"], headers: [{name: user_agent, prefix: bot}]}}
  rules:
    - name: per-key-host
      match:
        hosts: [api.example.com, "*.example.com"]
        methods: [GET, POST, DELETE]
      key: [{header: X-API-Key, missing: skip}, {host: true}, {method: true}]
      algorithm: fixedWindow
      limit: {requests: 10, per: 1s}
    - name: per-path
      match:
        paths: [{regex: "/users/[0-9]+(/.*)?"}, {exact: /Login, ignoreCase: true}]
      key: [{path: true}, {clientIP: true}, {header: user-agent}]
      algorithm: gcra
      limit: {requests: 5, per: 1s}
    - name: credential
      match: {headers: [{name: x-sluice-authorization, present: true}]}
      algorithm: fixedWindow
      limit: {requests: 1, per: 1s}
"#;

static SNAPSHOT: LazyLock<Snapshot> = LazyLock::new(|| {
    let mut policies = Vec::new();
    for (text, file) in
        [(include_str!("../../../examples/policies/layered.yaml"), "layered.yaml"), (EXTRA, "extra.yaml")]
    {
        let loaded = load_str(text, std::path::Path::new(file)).expect("the policies parse");
        policies.extend(loaded.into_iter().map(|l| l.policy));
    }
    let compiled = compile(policies);
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    compiled.snapshot
});

/// The workload's labels (the layered example selects `app: orders`).
static LABELS: LazyLock<BTreeMap<String, String>> =
    LazyLock::new(|| BTreeMap::from([("app".to_string(), "orders".to_string())]));

/// Methods, request targets, header names and values picked by small bytes (the rest are the
/// input's own): what the sidecar and the rules read, names in several spellings.
const METHODS: [&str; 5] = ["GET", "POST", "get", "DELETE", "CONNECT"];
const TARGETS: [&str; 10] = [
    "/orders/1",
    "/invoices/2?x=1",
    "/users/12/a/../b",
    "/LOGIN",
    "http://api.example.com/orders/1",
    "http://user@a.example.com/checkout",
    "*",
    "/checkout/a//b",
    "api.example.com:443",
    "/%6frders/1",
];
const VALUES: [&str; 14] = [
    "acme",
    "acme, evil",
    "203.0.113.7",
    "198.51.100.1, 203.0.113.7:80",
    "[2001:db8::1]:80, unknown",
    "upgrade",
    "websocket",
    "keep-alive, x-tenant",
    "x_api_key, host",
    "application/json",
    "bot/1.0",
    "api.example.com",
    "b.example.com:8080",
    "k1",
];
const NAMES: [&str; 22] = [
    "host",
    "x-forwarded-for",
    "connection",
    "upgrade",
    "x-tenant",
    "x_tenant",
    "X-Tenant",
    "x-api-key",
    "x_api_key",
    "x-sluice-authorization",
    "x_sluice_authorization",
    "keep-alive",
    "te",
    "transfer-encoding",
    "user-agent",
    "user_agent",
    "content-type",
    "x-forwarded-proto",
    "proxy-connection",
    "http2-settings",
    "trailer",
    "x-envoy-external-address",
];

/// Where the application sees the sidecar's connections come from.
const SIDECAR: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn resolved(view: &RequestView<'_>) -> Vec<(u64, String, u64)> {
    let mut matched: Vec<Matched<'_>> = Vec::new();
    SNAPSHOT.resolve(view, &mut matched);
    matched.iter().map(|m| (m.rule.id(), m.key.clone(), m.cost)).collect()
}

/// `list[pick]`, or `own` for a pick past the list.
fn pick<'a>(list: &[&'a str], pick: u8, own: &'a [u8]) -> &'a [u8] {
    list.get(usize::from(pick)).map_or(own, |s| s.as_bytes())
}

/// Control byte, peer address, method, target, and header names and values, each picked from
/// the lists above or the input's own.
type Head = (u8, [u8; 16], (u8, String), (u8, String), Vec<(u8, String, u8, Vec<u8>)>);

fuzz_target!(|head: Head| {
    let (control, address, (method_pick, method), (target_pick, target), fields) = head;
    // Bits 0-1: the version; bits 2-3: trusted hops; bits 4-5: the peer's address family.
    let version = [Version::HTTP_11, Version::HTTP_2, Version::HTTP_10, Version::HTTP_11][usize::from(control & 3)];
    let hops = usize::from(control >> 2 & 3);
    let peer = match control >> 4 & 3 {
        0 | 1 => IpAddr::V4(Ipv4Addr::new(address[0], address[1], address[2], address[3])),
        2 => IpAddr::V6(Ipv6Addr::from(address)),
        _ => IpAddr::V6(Ipv4Addr::new(address[0], address[1], address[2], address[3]).to_ipv6_mapped()),
    };
    let method = pick(&METHODS, method_pick, method.as_bytes());
    let target = pick(&TARGETS, target_pick, target.as_bytes());
    let mut builder = Request::builder().method(method).uri(target).version(version);
    for (name_pick, name, value_pick, value) in fields.iter().take(32) {
        let name = pick(&NAMES, *name_pick, name.as_bytes());
        let value = pick(&VALUES, *value_pick, value);
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) else { continue };
        builder = builder.header(name, value);
    }
    let Ok(mut request) = builder.body(()) else { return };

    // Connection-level headers go first; rules saw none of them anyway.
    let sent = request.headers().clone();
    let upgrade = is_websocket_upgrade(&request);
    strip_hop_by_hop(request.headers_mut(), upgrade);
    let headers = request.headers();
    let mut seen: Vec<String> = NAMES.iter().map(|n| canonical_header_name(n)).collect();
    seen.extend(sent.keys().map(|n| canonical_header_name(n.as_str())));
    for name in &seen {
        let one = std::slice::from_ref(name);
        let checked = check_used_headers(&sent, one);
        assert_eq!(checked, check_used_headers(headers, one), "header {name} once stripped");
        // The value rules see is defined for a request that passed the check: one with several
        // copies is refused first, and which copy comes first in a HeaderMap changes as other
        // headers are removed.
        if checked.is_ok() {
            assert_eq!(used_header_value(&sent, name), used_header_value(headers, name), "header {name} once stripped");
        }
    }
    let mut twice = headers.clone();
    strip_hop_by_hop(&mut twice, upgrade);
    assert_eq!(&twice, headers, "stripping twice");

    // Refused here (400, 414, 431) from now on: not a path, an ambiguous Host, used headers
    // sent twice or too large.
    let path = request.uri().path();
    if check_path(path).is_err() {
        return;
    }
    let client = client_ip(headers, peer, hops);
    assert_eq!(client, client.to_canonical());
    if hops == 0 {
        assert_eq!(client, peer.to_canonical(), "no trusted hops: the peer");
    }
    let Ok(host) = request_host(headers, request.uri().authority()) else { return };
    let used = SNAPSHOT.namespace_header_names(NAMESPACE);
    if check_used_headers(headers, used).is_err() {
        return;
    }
    let mut checked = BTreeMap::new();
    let mut bytes = 0;
    for name in used {
        if let Some(value) = used_header_value(headers, name) {
            bytes += name.len() + value.len();
            checked.insert(name.clone(), value.to_string());
        }
    }
    if bytes > MAX_CHECK_HEADER_BYTES {
        return;
    }
    let input = CheckInput {
        namespace: NAMESPACE,
        labels: &LABELS,
        method: request.method().as_str(),
        path,
        host,
        client_ip: client,
        headers: checked,
        request_fields: BTreeMap::new(),
        egress: None,
        deadline_ms: None,
        slot: None,
    };

    // The local fallback's view.
    let local = input.view();
    let matched = resolved(&local);
    for (_, key, _) in &matched {
        assert!(key.len() <= MAX_INLINE_KEY, "a key of {} bytes", key.len());
    }
    let path_only = path.split('?').next().unwrap_or(path);
    let once = normalize(path_only);
    assert_eq!(normalize(&once), once, "normalizing {path_only:?} twice");

    // The endpoint's view of the check the sidecar sends.
    let body = serde_json::to_vec(&input).expect("a check serializes");
    let request_sent = CheckRequest::from_json(&body)
        .unwrap_or_else(|e| panic!("the endpoint refuses {}: {e}", String::from_utf8_lossy(&body)));
    let endpoint = request_sent.view(&Caller::Open).expect("an open caller may name any namespace");
    assert_eq!(resolved(&endpoint), matched, "the endpoint and the local fallback resolve {input:?} apart");
    assert_eq!(SNAPSHOT.classify(&endpoint).0, SNAPSHOT.classify(&local).0, "overload class");
    assert_eq!(SNAPSHOT.exempt_from_overload(&endpoint), SNAPSHOT.exempt_from_overload(&local));

    // What the application is told: trusting the sidecar as one more hop, it names the same
    // client, unless the entry chosen is no address (then the limiter fell back to the peer).
    let mut forwarded: HeaderMap = headers.clone();
    set_forwarded(&mut forwarded, peer, hops);
    assert!(forwarded.contains_key(&X_FORWARDED_PROTO));
    let seen_by_app = client_ip(&forwarded, SIDECAR, hops + 1);
    assert!(
        seen_by_app == client || (client == peer.to_canonical() && seen_by_app == SIDECAR),
        "the limiter keyed on {client}, the application sees {seen_by_app}"
    );
});
