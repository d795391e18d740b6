//! Envoy's rate limit service (src/server/rls.rs): a `RateLimitRequest` (domain, descriptors of
//! key/value entries, `hits_addend`, per-descriptor `hits_addend`, `limit` and
//! `is_negative_hits`) put to `RateLimitService::should_rate_limit` by an open, a gateway, a
//! tenant or an unknown caller, with or without `grpc-timeout`, on the real engine and memory
//! store. Requests are built from the bytes (see [`decode`]) or, for one input in eight, decoded
//! from them as the protobuf wire form Envoy sends.
//!
//! Besides "no panic": a request is decided exactly when it is within the documented bounds
//! (domain a DNS label, 1 to 64 descriptors of 1 to 32 entries, keys 1 to 4096 bytes, values at
//! most 4096, no limit override, no negative hits, costs at most 2^32 − 1) and the caller may
//! ask (a tenant only in its namespace and never setting a cost); a refusal is
//! INVALID_ARGUMENT only for a request outside the bounds and PERMISSION_DENIED only for a
//! caller that may not; a decision has one status per descriptor and is OVER_LIMIT exactly when
//! one of them is. The conversion the engine decides on (each descriptor as a `RequestView`,
//! resolved against the snapshot) is deterministic, its keys are bounded, and a descriptor gets
//! a `current_limit` exactly when it reaches a rule.
#![no_main]

use std::sync::{Arc, LazyLock};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::google::protobuf::UInt64Value;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use sluice::clock::SystemClock;
use sluice::policy::{Matched, RequestView, Snapshot, compile, load_str};
use sluice::rule::MAX_INLINE_KEY;
use sluice::server::auth::{AUTHORIZATION_HEADER, Auth, AuthFuture, Authenticator, Caller};
use sluice::engine::Engine;
use sluice::engine::MAX_COST;
use sluice::server::rls::{MAX_DESCRIPTORS, MAX_ENTRIES, MAX_ENTRY_BYTES, RateLimiter};
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: edge, namespace: gateway-limits}
spec:
  rules:
    - name: per-client
      match: {descriptor: [{key: remote_address}]}
      key: [{descriptor: remote_address}]
      algorithm: fixedWindow
      limit: {requests: 100, per: 1h}
    - name: per-api-key
      match: {descriptor: [{key: api_key, notIn: [unlimited]}]}
      key: [{descriptor: api_key}]
      algorithm: tokenBucket
      limit: {requests: 1, per: 1h, burst: 5}
    - name: bots
      match: {descriptor: [{key: user_agent, prefix: bot}]}
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
      mode: shadow
    - name: per-route
      match: {descriptor: [{key: generic_key, exact: orders}, {key: path, regex: "/orders/[0-9]+"}]}
      key: [{descriptor: path}, {literal: orders}]
      algorithm: slidingWindowCounter
      limit: {requests: 3, per: 1s}
    - name: headers
      match: {descriptor: [{key: header_match, notPrefix: [internal]}]}
      key: [{descriptor: header_match}]
      algorithm: slidingWindowLog
      limit: {requests: 2, per: 1s}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: own, namespace: tenant-a}
spec:
  rules:
    - name: any
      match: {descriptor: [{key: k}]}
      key: [{descriptor: k}, {namespace: true}]
      algorithm: gcra
      limit: {requests: 10, per: 1s}
"#;

const GATEWAY_TOKEN: &str = "gateway-token-0123456789";
const TENANT_TOKEN: &str = "tenant-a-token-0123456789";
const TENANT_NAMESPACE: &str = "tenant-a";

/// Domains, descriptor keys and values that the policies name, picked by most bytes.
const DOMAINS: [&str; 4] = ["gateway-limits", TENANT_NAMESPACE, "default", "Gateway-Limits"];
const KEYS: [&str; 9] =
    ["remote_address", "api_key", "user_agent", "generic_key", "path", "header_match", "k", "", "destination_cluster"];
const VALUES: [&str; 8] = ["203.0.113.7", "unlimited", "bot-1", "orders", "/orders/12", "internal-x", "", "k1"];

struct Tokens;

impl Authenticator for Tokens {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a> {
        Box::pin(async move {
            Ok(match token {
                GATEWAY_TOKEN => Some(Caller::Gateway { name: "edge".into() }),
                TENANT_TOKEN => {
                    Some(Caller::Tenant { name: "sa-a".into(), namespaces: vec![TENANT_NAMESPACE.to_string()].into() })
                }
                _ => None,
            })
        })
    }
}

struct Service {
    runtime: tokio::runtime::Runtime,
    snapshot: Arc<Snapshot>,
    /// Without authentication (every caller open), and with [`Tokens`]; each with and without
    /// response headers.
    open: [RateLimiter<Arc<MemoryStore>>; 2],
    authenticated: [RateLimiter<Arc<MemoryStore>>; 2],
}

static SERVICE: LazyLock<Service> = LazyLock::new(|| {
    let loaded = load_str(POLICIES, std::path::Path::new("rls.yaml")).expect("the policies parse");
    let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    let snapshot = Arc::new(compiled.snapshot);
    let engine =
        Arc::new(Engine::new(Arc::new(MemoryStore::new(10_000)), Arc::new(SystemClock), Arc::new(Metrics::new())));
    engine.install(snapshot.clone());
    let auth = Auth::new(vec![Arc::new(Tokens)]);
    Service {
        runtime: tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime"),
        snapshot,
        open: [false, true].map(|headers| RateLimiter::new(engine.clone(), Auth::off(), headers)),
        authenticated: [false, true].map(|headers| RateLimiter::new(engine.clone(), auth.clone(), headers)),
    }
});

/// The fuzz input, read front to back; zeros once it runs out.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    /// A length-prefixed text: lengths from 0xF0 on are 4090 to 4105 bytes of `x`, across the
    /// 4096-byte bound.
    fn text(&mut self) -> String {
        let len = self.byte();
        if len >= 0xF0 {
            return "x".repeat(4090 + usize::from(len - 0xF0));
        }
        let n = usize::from(len).min(self.0.len());
        let (text, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8_lossy(text).into_owned()
    }

    /// A name from `names` for a byte below 0xC0, otherwise a text.
    fn pick(&mut self, names: &[&str]) -> String {
        match self.byte() {
            b @ 0..0xC0 => names[usize::from(b) % names.len()].to_string(),
            _ => self.text(),
        }
    }

    /// Mostly `usual` (from 1), sometimes anything up to `max`.
    fn count(&mut self, usual: u8, max: u8) -> usize {
        match self.byte() {
            b @ 0..0xC0 => usize::from(1 + b % usual),
            b => usize::from(b % (max + 1)),
        }
    }

    /// A cost: small ones mostly, and the edges.
    fn cost(&mut self) -> u64 {
        match self.byte() {
            0xFF => MAX_COST,
            0xFE => MAX_COST + 1,
            0xFD => u64::MAX,
            b => u64::from(b % 8),
        }
    }
}

/// A request from the bytes, mostly well-formed and naming what the policies match on, and
/// sometimes not: domain, `hits_addend`, descriptor count (mostly 1 to 4, up to 69), then per
/// descriptor a flags byte (bit 0: `hits_addend`; bits 4-5 both: a limit override; bits 6-7
/// both: `is_negative_hits`), its entry count (mostly 1 or 2, up to 34) and entries.
fn decode(r: &mut Reader<'_>) -> RateLimitRequest {
    let domain = r.pick(&DOMAINS);
    let hits_addend = u32::try_from(r.cost()).unwrap_or(u32::MAX);
    let count = r.count(4, 69);
    let descriptors = (0..count)
        .map(|_| {
            let flags = r.byte();
            let hits_addend = (flags & 1 != 0).then(|| UInt64Value { value: r.cost() });
            let limit = (flags & 0x30 == 0x30).then_some(RateLimitOverride { requests_per_unit: 10, unit: 1 });
            let entries = (0..r.count(2, 34)).map(|_| Entry { key: r.pick(&KEYS), value: r.pick(&VALUES) });
            RateLimitDescriptor {
                entries: entries.collect(),
                limit,
                hits_addend,
                is_negative_hits: flags & 0xC0 == 0xC0,
            }
        })
        .collect();
    RateLimitRequest { domain, descriptors, hits_addend }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 bytes: a namespace name.
fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Each descriptor's cost: its own `hits_addend`, else the request's, else 1.
fn costs(request: &RateLimitRequest) -> Vec<u64> {
    let request_cost = if request.hits_addend == 0 { 1 } else { u64::from(request.hits_addend) };
    request
        .descriptors
        .iter()
        .map(|d| d.hits_addend.filter(|h| h.value > 0).map_or(request_cost, |h| h.value))
        .collect()
}

/// Whether the request is outside the documented bounds.
fn malformed(request: &RateLimitRequest) -> bool {
    !is_dns_label(&request.domain)
        || request.descriptors.is_empty()
        || request.descriptors.len() > MAX_DESCRIPTORS
        || request.descriptors.iter().any(|d| {
            d.entries.is_empty()
                || d.entries.len() > MAX_ENTRIES
                || d.entries
                    .iter()
                    .any(|e| e.key.is_empty() || e.key.len() > MAX_ENTRY_BYTES || e.value.len() > MAX_ENTRY_BYTES)
                || d.limit.is_some()
                || d.is_negative_hits
        })
        || costs(request).iter().any(|&c| c > MAX_COST)
}

/// Whether `caller` may not ask this.
fn forbidden(request: &RateLimitRequest, caller: &Caller) -> bool {
    let sets_cost = request.hits_addend > 1 || costs(request).iter().any(|&c| c > 1);
    !caller.may_use(&request.domain) || (sets_cost && !caller.is_trusted())
}

fuzz_target!(|data: &[u8]| {
    let service = &*SERVICE;
    let mut r = Reader(data);
    // The control byte: bits 3-5 all set, the rest is the protobuf wire form; bits 0-1, the
    // caller (open, gateway, tenant, none or an unknown token by bit 7); bit 2, response
    // headers; bit 6, a grpc-timeout (the last 4 bytes, as text).
    let control = r.byte();
    let request = if control & 0x38 == 0x38 {
        match RateLimitRequest::decode(r.0) {
            Ok(request) => request,
            Err(_) => return,
        }
    } else {
        decode(&mut r)
    };

    let headers = usize::from(control >> 2 & 1);
    let (limiter, token, caller) = match control & 3 {
        0 => (&service.open[headers], None, Some(Caller::Open)),
        1 => (&service.authenticated[headers], Some(GATEWAY_TOKEN), Some(Caller::Gateway { name: "edge".into() })),
        2 => (
            &service.authenticated[headers],
            Some(TENANT_TOKEN),
            Some(Caller::Tenant { name: "sa-a".into(), namespaces: vec![TENANT_NAMESPACE.to_string()].into() }),
        ),
        _ => (&service.authenticated[headers], (control & 0x80 != 0).then_some("unknown-token-0123456789"), None),
    };
    let mut grpc = tonic::Request::new(request.clone());
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().expect("an ASCII value");
        grpc.metadata_mut().insert(AUTHORIZATION_HEADER, value);
    }
    if control & 0x40 != 0 {
        let timeout = data.get(data.len().saturating_sub(4)..).unwrap_or_default();
        if let Ok(value) = String::from_utf8_lossy(timeout).parse() {
            grpc.metadata_mut().insert("grpc-timeout", value);
        }
    }

    let answer = service.runtime.block_on(limiter.should_rate_limit(grpc));

    let Some(caller) = caller else {
        let status = answer.expect_err("no caller, no decision");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        return;
    };
    let (malformed, forbidden) = (malformed(&request), forbidden(&request, &caller));
    let response = match answer {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let allowed = match status.code() {
                tonic::Code::InvalidArgument => malformed,
                tonic::Code::PermissionDenied => forbidden,
                _ => false,
            };
            assert!(allowed, "refused {status:?}; malformed {malformed}, forbidden {forbidden}");
            return;
        }
    };
    assert!(!malformed && !forbidden, "decided; malformed {malformed}, forbidden {forbidden}");
    assert_eq!(response.statuses.len(), request.descriptors.len(), "one status per descriptor");
    let over = response.statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    assert!(response.overall_code == Code::Ok as i32 || response.overall_code == Code::OverLimit as i32);
    assert_eq!(response.overall_code == Code::OverLimit as i32, over, "{response:?}");

    // The conversion the engine decides on, per descriptor.
    let costs = costs(&request);
    let mut once: Vec<Matched<'_>> = Vec::new();
    let mut twice: Vec<Matched<'_>> = Vec::new();
    for ((descriptor, &cost), status) in request.descriptors.iter().zip(&costs).zip(&response.statuses) {
        let view = RequestView::descriptor(&request.domain, descriptor, cost);
        service.snapshot.resolve(&view, &mut once);
        service.snapshot.resolve(&view, &mut twice);
        let ids = |m: &[Matched<'_>]| m.iter().map(|m| (m.rule.id(), m.key.clone(), m.cost)).collect::<Vec<_>>();
        assert_eq!(ids(&once), ids(&twice), "resolving one descriptor twice");
        for m in &once {
            assert!(m.key.len() <= MAX_INLINE_KEY, "a key of {} bytes", m.key.len());
        }
        let decided: Vec<&str> = once.iter().map(|m| m.rule.name()).collect();
        match &status.current_limit {
            None => assert!(decided.is_empty(), "no limit stated, but rules {decided:?} apply"),
            Some(limit) => assert!(
                decided.iter().any(|name| limit.name.ends_with(&format!("/{name}"))),
                "limit {:?} stated, rules {decided:?} apply",
                limit.name
            ),
        }
    }
});
