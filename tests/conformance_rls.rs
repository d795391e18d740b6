//! The conformance vectors through Envoy's rate limit service (`ShouldRateLimit`), in-process
//! on a fake clock (RLS requests carry no time): each vector rule becomes a policy rule matching
//! the descriptor `[(rule, NAME), (k, KEY)]`, and each step one request with a descriptor per
//! rule it checks, `hits_addend` = the step's cost (a cost of 0 as each descriptor's own
//! `hits_addend: 0`, since the request's 0 means 1). What RLS reports is compared: the overall
//! code, how many repetitions were admitted, and per descriptor its code (enforcing rules),
//! `limit_remaining` and `duration_until_reset`. Retry-after and delay are not part of a
//! descriptor status (Retry-After travels as a header; Envoy cannot delay a request).
//!
//! Vectors of rules whose cost is known after the response run when every check reserves 0:
//! that is how Envoy asks (`hits_addend: 0` at admission), and each settle is the cost Envoy
//! reports after the stream (`apply_on_stream_done`), charged in full.

// The runner's store-level half is not used here.
#[allow(dead_code)]
#[path = "common/conformance.rs"]
mod conformance;

use conformance::{T0, load};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use sluice::duration::parse_duration;
use sluice::server::auth::Auth;
use sluice::server::rls::RateLimiter;

/// Each rule matches descriptors `rule=<name>, k=<key>` and counts per `k` (namespace = domain).
fn selects(name: &str) -> String {
    format!("    match: {{descriptor: [{{key: rule, exact: {name}}}, {{key: k}}]}}\n    key: [{{descriptor: k}}]\n")
}

/// The descriptor of `rule` and `key`; with `zero`, its own `hits_addend` is 0.
fn descriptor(rule: &str, key: &str, zero: bool) -> RateLimitDescriptor {
    let entry = |key: &str, value: &str| Entry { key: key.into(), value: value.into() };
    RateLimitDescriptor {
        entries: vec![entry("rule", rule), entry("k", key)],
        hits_addend: zero.then_some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
        ..Default::default()
    }
}

fn micros(text: &str) -> u64 {
    parse_duration(text).unwrap()
}

#[tokio::test]
async fn every_vector_decides_the_same_through_the_rate_limit_service() {
    let vectors = load();
    let (engine, clock) = conformance::engine_for(&vectors, selects);
    let limiter = RateLimiter::new(engine, Auth::off(), true);

    let mut failures = Vec::new();
    let mut compared = 0;
    for (vi, vector) in vectors.iter().enumerate() {
        // Reservations need a settle, which the rate limit service never gets (Envoy reports a
        // cost after the response as a plain hits_addend): the memory, Redis and HTTP suites hold
        // the vectors that reserve more than 0.
        let reserving = vector.rules.0.iter().any(|(_, spec)| spec.reserve_for.is_some());
        if reserving && vector.steps.iter().any(|step| !step.settle && step.cost > 0) {
            continue;
        }
        let all: Vec<String> = vector.rules.0.iter().map(|(name, _)| name.clone()).collect();
        for (si, step) in vector.steps.iter().enumerate() {
            let context = format!("{} / step {} (at {})", vector.name, si + 1, step.at);
            let names = step.rules.clone().unwrap_or_else(|| all.clone());
            let key = step.key.clone().unwrap_or_else(|| "k".into());
            let zero = step.cost == 0;
            let request = RateLimitRequest {
                domain: format!("v{vi}"),
                descriptors: names.iter().map(|n| descriptor(n, &key, zero)).collect(),
                hits_addend: step.cost as u32,
            };
            clock.set(T0 + micros(&step.at));
            if step.settle {
                // The cost Envoy reports after the stream: charged whatever the answer says.
                if let Err(status) = limiter.should_rate_limit(tonic::Request::new(request)).await {
                    failures.push(format!("{context}: {status:?}"));
                }
                continue;
            }
            let mut admitted = 0;
            let mut last = None;
            for _ in 0..step.repeat {
                match limiter.should_rate_limit(tonic::Request::new(request.clone())).await {
                    Ok(response) => {
                        let response = response.into_inner();
                        admitted += u64::from(response.overall_code == Code::Ok as i32);
                        last = Some(response);
                    }
                    Err(status) => {
                        failures.push(format!("{context}: {status:?}"));
                        break;
                    }
                }
            }
            let Some(response) = last else { continue };
            let mut check = |field: &str, want: String, got: String| {
                compared += 1;
                if want != got {
                    failures.push(format!("{context}: {field}: expected {want}, got {got}"));
                }
            };
            let e = &step.expect;
            if let Some(w) = e.allowed {
                check("allowed", w.to_string(), (response.overall_code == Code::Ok as i32).to_string());
            }
            if let Some(w) = e.admitted {
                check("admitted", w.to_string(), admitted.to_string());
            }
            if response.statuses.len() != names.len() {
                failures.push(format!(
                    "{context}: {} statuses for {} descriptors",
                    response.statuses.len(),
                    names.len()
                ));
                continue;
            }
            for (i, name) in names.iter().enumerate() {
                let (allowed, remaining, reset_after) = if let Some(w) = e.rules.get(name) {
                    (w.allowed, w.remaining, w.reset_after.clone())
                } else if names.len() == 1 {
                    (e.rule_allowed, e.remaining, e.reset_after.clone())
                } else {
                    continue;
                };
                let status = &response.statuses[i];
                let shadow = vector.rules.0.iter().any(|(n, s)| n == name && s.mode.as_deref() == Some("shadow"));
                if let (Some(w), false) = (allowed, shadow) {
                    check(&format!("{name} code"), w.to_string(), (status.code == Code::Ok as i32).to_string());
                }
                if let Some(w) = remaining {
                    check(&format!("{name} limit_remaining"), w.to_string(), status.limit_remaining.to_string());
                }
                if let Some(w) = reset_after.as_deref() {
                    let reset = status.duration_until_reset.expect("duration_until_reset is always set");
                    let got_ms = reset.seconds as u64 * 1000 + reset.nanos as u64 / 1_000_000;
                    check(
                        &format!("{name} duration_until_reset"),
                        micros(w).div_ceil(1000).to_string(),
                        got_ms.to_string(),
                    );
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    assert!(compared > 100, "only {compared} comparisons: the mapping lost the vectors");
}
