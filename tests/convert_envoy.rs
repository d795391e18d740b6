//! `sluice convert envoy-ratelimit` on a realistic envoyproxy/ratelimit configuration
//! (examples/envoy-ratelimit/config.yaml: wildcard and exact siblings, a prefix wildcard,
//! nesting, `unlimited`, `shadow_mode`), then enforced through `ShouldRateLimit` decision by
//! decision against what envoyproxy/ratelimit decides for it, written out by hand.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use sluice::algorithm::Algorithm;
use sluice::clock::FakeClock;
use sluice::engine::Engine;
use sluice::server::auth::Auth;
use sluice::server::rls::RateLimiter;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;

/// A whole day, so every unit's window starts here.
const T0: u64 = 1_699_920_000_000_000;
const CONFIG: &str = include_str!("../examples/envoy-ratelimit/config.yaml");

struct Rls {
    clock: FakeClock,
    limiter: RateLimiter<Arc<MemoryStore>>,
}

/// What one descriptor's status says: (under the limit, remaining, the limit's name if any).
type Status = (bool, u32, Option<String>);

impl Rls {
    fn new() -> Rls {
        let converted = sluice::convert::envoy_ratelimit(CONFIG, None, Algorithm::FixedWindow).expect("converts");
        let compiled = sluice::policy::compile(converted.policies);
        assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
        let clock = FakeClock::new(T0);
        let shared = Arc::new(clock.clone());
        let store = Arc::new(MemoryStore::with_clock(10_000, shared.clone()));
        let engine = Arc::new(Engine::new(store, shared, Arc::new(Metrics::new())));
        engine.install(Arc::new(compiled.snapshot));
        Rls { clock, limiter: RateLimiter::new(engine, Auth::off(), false) }
    }

    async fn ask(&self, descriptors: &[&[(&str, &str)]]) -> RateLimitResponse {
        let request = RateLimitRequest {
            domain: "edge-proxy".into(),
            descriptors: descriptors
                .iter()
                .map(|entries| RateLimitDescriptor {
                    entries: entries.iter().map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() }).collect(),
                    ..Default::default()
                })
                .collect(),
            hits_addend: 0,
        };
        self.limiter.should_rate_limit(tonic::Request::new(request)).await.expect("decided").into_inner()
    }

    /// One descriptor: whether the request passed, and its status.
    async fn one(&self, entries: &[(&str, &str)]) -> (bool, Status) {
        let response = self.ask(&[entries]).await;
        let status = &response.statuses[0];
        let limit = status.current_limit.as_ref().map(|l| l.name.clone());
        (response.overall_code == Code::Ok as i32, (status.code == Code::Ok as i32, status.limit_remaining, limit))
    }

    /// How many of `n` requests of one descriptor pass.
    async fn admitted(&self, n: usize, entries: &[(&str, &str)]) -> usize {
        let mut passed = 0;
        for _ in 0..n {
            passed += usize::from(self.one(entries).await.0);
        }
        passed
    }
}

#[tokio::test]
async fn a_converted_envoy_ratelimit_config_decides_like_envoy_ratelimit() {
    let rls = Rls::new();
    let client = |ip: &'static str| [("remote_address", ip)];

    // Each address 5 a minute, counted separately; the monitor is unlimited (no limit reported).
    assert_eq!(rls.admitted(7, &client("192.0.2.1")).await, 5);
    assert_eq!(rls.admitted(7, &client("192.0.2.2")).await, 5);
    assert_eq!(rls.admitted(50, &client("10.0.0.1")).await, 50);
    assert_eq!(rls.one(&client("10.0.0.1")).await, (true, (true, 0, None)));
    assert_eq!(rls.one(&client("192.0.2.1")).await, (false, (false, 0, Some("edge-proxy/remote-address".into()))));

    // Under generic_key=api: /login 2 a minute (not also counted by the catch-all), /orders…
    // 3 a second per path, every other path 10 a second per path.
    let api = |path: &'static str| [("generic_key", "api"), ("path", path)];
    assert_eq!(rls.admitted(4, &api("/login")).await, 2);
    assert_eq!(rls.admitted(5, &api("/orders/1")).await, 3);
    assert_eq!(rls.admitted(5, &api("/orders/2")).await, 3);
    assert_eq!(rls.admitted(12, &api("/catalog")).await, 10);
    assert_eq!(rls.one(&api("/search")).await, (true, (true, 9, Some("edge-proxy/generic-key-api-path".into()))));
    // Another generic_key value is no node of the tree: not limited.
    assert_eq!(rls.admitted(20, &[("generic_key", "web"), ("path", "/login")]).await, 20);
    // A descriptor that stops above the leaves has no limit of its own.
    assert_eq!(rls.one(&[("generic_key", "api")]).await, (true, (true, 0, None)));

    // api_key: 4 an hour; with method=POST also one a minute (a separate descriptor in Envoy's
    // request, as its rate_limits actions produce).
    let key = [("api_key", "k1")];
    let post = [("api_key", "k1"), ("method", "POST")];
    assert_eq!(rls.ask(&[&key, &post]).await.overall_code, Code::Ok as i32);
    let denied = rls.ask(&[&key, &post]).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32, "the second POST in a minute");
    assert_eq!((denied.statuses[0].code, denied.statuses[0].limit_remaining), (Code::Ok as i32, 3), "unchanged");
    assert_eq!(denied.statuses[1].code, Code::OverLimit as i32);
    assert_eq!(rls.one(&[("api_key", "k1"), ("method", "GET")]).await.1.2, None, "GET is no node");
    assert_eq!(rls.admitted(5, &key).await, 3, "the denied POST consumed nothing of the hourly 4");

    // The bot limit is shadow: reported, never enforced.
    let bot = [("user_agent", "bot-crawler")];
    assert_eq!(rls.admitted(5, &bot).await, 5);
    assert_eq!(rls.one(&bot).await, (true, (true, 0, Some("edge-proxy/user-agent-bot".into()))));

    // Windows start over with their unit.
    rls.clock.set(T0 + 60_000_000);
    assert_eq!(rls.admitted(3, &api("/login")).await, 2);
    assert_eq!(rls.admitted(6, &client("192.0.2.1")).await, 5);
    assert_eq!(rls.admitted(1, &key).await, 0, "the hour is not over");
}

#[test]
fn what_has_no_equivalent_is_noted_and_bad_input_is_refused() {
    let converted = sluice::convert::envoy_ratelimit(CONFIG, None, Algorithm::FixedWindow).unwrap();
    assert_eq!(converted.notes.len(), 1, "{:?}", converted.notes);
    assert!(converted.notes[0].contains("detailed_metric"));

    let refused = |yaml: &str| sluice::convert::envoy_ratelimit(yaml, None, Algorithm::FixedWindow).unwrap_err().0;
    assert!(refused("domain: Edge_Proxy\ndescriptors: []\n").contains("--namespace"));
    assert!(
        refused("domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}]\n")
            .contains("unknown unit")
    );
    assert!(refused("domain: d\ndescriptors: [{key: k, ratelimit: {}}]\n").contains("unknown field"));
    let renamed = sluice::convert::envoy_ratelimit(
        "domain: Edge_Proxy\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]\n",
        Some("edge"),
        Algorithm::SlidingWindowCounter,
    )
    .unwrap();
    assert_eq!(renamed.policies[0].metadata.namespace.as_deref(), Some("edge"));
    assert_eq!(renamed.policies[0].spec.rules[0].algorithm, Algorithm::SlidingWindowCounter);
}

#[test]
fn the_cli_prints_policies_that_load() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["convert", "envoy-ratelimit", "examples/envoy-ratelimit/config.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let yaml = String::from_utf8(output.stdout).unwrap();
    let loaded = sluice::policy::load_str(&yaml, std::path::Path::new("converted.yaml")).expect("loads");
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].policy.spec.rules.len(), 7);
}
