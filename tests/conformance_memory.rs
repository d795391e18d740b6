//! The memory store passes every conformance vector.

#[allow(dead_code)] // the policy text generator serves the HTTP and RLS suites
#[path = "common/conformance.rs"]
mod conformance;

use sluice::store::memory::MemoryStore;

#[tokio::test]
async fn memory_store_passes_every_vector() {
    let store = MemoryStore::new(100_000);
    let failures = conformance::run(&store).await;
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn vectors_cover_every_algorithm() {
    let vectors = conformance::load();
    for algorithm in sluice::algorithm::Algorithm::ALL {
        assert!(
            vectors.iter().any(|v| v.rules.0.iter().any(|(_, r)| r.algorithm == algorithm)),
            "no vector for {algorithm}"
        );
    }
}

/// The runner itself must be able to fail: wrong expectations are reported, field by field.
#[tokio::test]
async fn runner_reports_mismatches() {
    let bogus: Vec<conformance::Vector> = serde_yaml::from_str(
        "- name: wrong on purpose\n  rules: {a: {algorithm: fixedWindow, requests: 1, per: 1s}}\n  steps:\n    - {at: 0ms, repeat: 2, expect: {allowed: true, admitted: 2, remaining: 1, retryAfter: never}}\n",
    )
    .unwrap();
    let failures = conformance::run_vectors(&MemoryStore::new(100), &bogus).await;
    assert_eq!(failures.len(), 4, "{failures:#?}");
    assert!(failures[0].contains("allowed: expected true, got false"), "{failures:#?}");
}
