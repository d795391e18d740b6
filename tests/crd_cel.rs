//! The CRD's CEL rules, evaluated client-side with kube's CEL validator: each rule parses, valid
//! policies pass, and each single-object mistake is caught by the rule meant for it.

use kube::core::cel::validate_cel;
use sluice::policy::RateLimitPolicy;

fn policy(spec: &str) -> RateLimitPolicy {
    serde_yaml::from_str(&format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: p, namespace: ns}}\nspec:\n{spec}"
    ))
    .expect("test policy parses")
}

fn cel_errors(spec: &str) -> String {
    match validate_cel(&policy(spec)) {
        Ok(()) => String::new(),
        Err(e) => format!("{e:?}"),
    }
}

#[test]
fn examples_pass_cel() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/policies");
    for loaded in sluice::policy::load_paths(&[dir]).expect("examples load") {
        if let Err(e) = validate_cel(&loaded.policy) {
            panic!("{}: {e:?}", loaded.file.display());
        }
    }
}

#[test]
fn each_cel_rule_catches_its_mistake() {
    let rule = |extra: &str| {
        format!("  rules:\n  - name: r\n    algorithm: gcra\n    limit: {{requests: 10, per: 1s}}\n{extra}")
    };
    let cases: &[(&str, String)] = &[
        (
            "rule names must be unique",
            format!("{}  - {{name: r, algorithm: gcra, limit: {{requests: 1, per: 1s}}}}\n", rule("")),
        ),
        (
            "limit.requests must be at least 1",
            "  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 0, per: 1s}}\n".into(),
        ),
        (
            "limit.burst is only used",
            "  rules:\n  - {name: r, algorithm: fixedWindow, limit: {requests: 5, per: 1s, burst: 5}}\n".into(),
        ),
        (
            "limit.maxDelay is only used",
            "  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 5, per: 1s, maxDelay: 1s}}\n".into(),
        ),
        (
            "cost must not exceed",
            "  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 5, per: 1s, burst: 2}, cost: 3}\n".into(),
        ),
        (
            "cost must not exceed",
            "  rules:\n  - {name: r, algorithm: fixedWindow, limit: {requests: 5, per: 1s}, cost: 6}\n".into(),
        ),
        ("per must be a duration", "  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 5, per: 1x}}\n".into()),
        (
            "maxDelay must be a duration",
            "  rules:\n  - {name: r, algorithm: leakyBucket, limit: {requests: 5, per: 1s, maxDelay: soon}}\n".into(),
        ),
        ("a path match needs exactly one", rule("    match: {paths: [{exact: /a, prefix: /b}]}\n")),
        ("a path match needs exactly one", rule("    match: {paths: [{}]}\n")),
        ("a header match needs exactly one", rule("    match: {headers: [{name: x}]}\n")),
        ("a key part needs exactly one", rule("    key: [{header: x, clientIP: true}]\n")),
        ("are written as `NAME: true`", rule("    key: [{path: false}]\n")),
        ("missing only applies", rule("    key: [{path: true, missing: skip}]\n")),
    ];
    for (want, spec) in cases {
        let errors = cel_errors(spec);
        assert!(errors.contains(want), "expected {want:?} for\n{spec}got: {errors}");
    }
    assert_eq!(cel_errors(&rule("    key: [{header: X-Key, missing: skip}, {clientIP: true}]\n    cost: 10\n")), "");
}
