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
        // `namespace` is a CEL reserved word, reached as `__namespace__`.
        ("are written as `NAME: true`", rule("    key: [{namespace: false}]\n")),
        ("missing only applies", rule("    key: [{path: true, missing: skip}]\n")),
        ("a descriptor entry takes at most one", rule("    match: {descriptor: [{key: a, exact: x, prefix: y}]}\n")),
        ("match.descriptor cannot be combined", rule("    match: {methods: [GET], descriptor: [{key: a}]}\n")),
        ("a descriptor key part needs an entry", rule("    key: [{descriptor: a}]\n")),
        (
            "a descriptor key part needs an entry",
            rule("    match: {descriptor: [{key: a}]}\n    key: [{descriptor: b}]\n"),
        ),
        (
            "a rule matching descriptors keys only",
            rule("    match: {descriptor: [{key: a}]}\n    key: [{header: x-api-key}]\n"),
        ),
    ];
    for (want, spec) in cases {
        let errors = cel_errors(spec);
        assert!(errors.contains(want), "expected {want:?} for\n{spec}got: {errors}");
    }
    assert_eq!(cel_errors(&rule("    key: [{header: X-Key, missing: skip}, {clientIP: true}]\n    cost: 10\n")), "");
    assert_eq!(
        cel_errors(&rule(
            "    match: {descriptor: [{key: generic_key, exact: api}, {key: path, notIn: [/a], notPrefix: [/b]}]}\n    key: [{descriptor: path}, {namespace: true}, {literal: x}]\n"
        )),
        ""
    );
}

/// The budgets CEL can count: slidingWindowLog requests per window and regexes per policy
/// (their compiled size only the webhook measures).
#[test]
fn cel_enforces_the_budgets_it_can_count() {
    let log = |requests: u64| {
        format!(
            "  rules:\n  - {{name: a, algorithm: gcra, limit: {{requests: 5, per: 1s}}}}\n  - {{name: b, algorithm: fixedWindow, limit: {{requests: 5, per: 1s}}}}\n  - {{name: log, algorithm: slidingWindowLog, limit: {{requests: {requests}, per: 1m}}}}\n"
        )
    };
    assert_eq!(cel_errors(&log(1000)), "");
    let errors = cel_errors(&log(1001));
    assert!(
        errors.contains(
            "slidingWindowLog allows at most 1000 requests per window; use slidingWindowCounter for larger limits"
        ) && errors.contains("spec.rules[2].limit.requests"),
        "{errors}"
    );
    assert_eq!(
        cel_errors("  rules:\n  - {name: c, algorithm: slidingWindowCounter, limit: {requests: 1000000, per: 1h}}\n"),
        ""
    );

    // 32 path regexes and 32 header regexes in one rule: 64, the budget; one more rule with one
    // regex (beside an exact path, which does not count) is over it.
    let paths = vec![r#"{regex: "/a[0-9]+"}"#; 32].join(", ");
    let headers = vec![r#"{name: x, regex: "a[0-9]+"}"#; 32].join(", ");
    let full = format!(
        "  rules:\n  - {{name: a, algorithm: gcra, limit: {{requests: 5, per: 1s}}, match: {{paths: [{paths}], headers: [{headers}]}}}}\n  - {{name: b, algorithm: gcra, limit: {{requests: 5, per: 1s}}}}\n"
    );
    assert_eq!(cel_errors(&full), "");
    let over = format!(
        "{full}  - {{name: c, algorithm: gcra, limit: {{requests: 5, per: 1s}}, match: {{paths: [{{exact: /x}}, {{regex: \"/b\"}}]}}}}\n"
    );
    let errors = cel_errors(&over);
    assert!(
        errors.contains(
            "at most 64 regexes per policy (match.paths, match.headers and match.descriptor of all rules and priorities together)"
        ) && errors.contains("spec.rules"),
        "{errors}"
    );
}

/// A policy with `overload` may have no rules; one with neither is refused. The overload fields'
/// own rules, and priorities' regexes count against the budget.
#[test]
fn overload_policies_pass_cel_and_its_mistakes_are_caught() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/overload");
    for loaded in sluice::policy::load_paths(&[dir]).expect("examples load") {
        if let Err(e) = validate_cel(&loaded.policy) {
            panic!("{}: {e:?}", loaded.file.display());
        }
    }
    assert_eq!(cel_errors("  overload: {}\n  rules: []\n"), "");
    assert!(cel_errors("  rules: []\n").contains("at least one rule is required (or spec.overload, or spec.egress)"));
    assert!(
        cel_errors("  overload: {minLimit: 10, maxLimit: 5, initialLimit: 7}\n  rules: []\n")
            .contains("overload.minLimit must not exceed overload.maxLimit")
    );
    assert!(
        cel_errors("  overload: {defaultShare: 40, sheddableShare: 60}\n  rules: []\n")
            .contains("overload.sheddableShare must not exceed overload.defaultShare")
    );
    let many: String =
        (0..65).map(|i| format!("    - {{class: critical, match: {{paths: [{{regex: '/a{i}'}}]}}}}\n")).collect();
    assert!(
        cel_errors(&format!("  overload: {{}}\n  priorities:\n{many}  rules: []\n")).contains("at most 64 regexes")
    );
}

/// The LLM example passes CEL; responseCost's own rules catch their mistakes.
#[test]
fn response_cost_policies_pass_cel_and_their_mistakes_are_caught() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/llm");
    for loaded in sluice::policy::load_paths(&[dir]).expect("examples load") {
        if let Err(e) = validate_cel(&loaded.policy) {
            panic!("{}: {e:?}", loaded.file.display());
        }
    }
    let rule = |response_cost: &str| {
        format!(
            "  rules:\n  - name: t\n    algorithm: fixedWindow\n    limit: {{requests: 1000, per: 1m}}\n    responseCost: {response_cost}\n"
        )
    };
    assert_eq!(cel_errors(&rule("{fields: [usage.total_tokens], estimate: {constant: 10}}")), "");
    assert!(cel_errors(&rule("{estimate: {constant: 10}}")).contains("responseCost needs fields or a header"));
    assert!(
        cel_errors(&rule("{fields: [a], estimate: {requestField: max_tokens}}"))
            .contains("estimate.requestField needs a cap")
    );
    assert!(
        cel_errors(&rule("{fields: [a], estimate: {constant: 1, requestField: b, cap: 2}}"))
            .contains("exactly one of constant or requestField")
    );
    assert!(
        cel_errors(&rule("{fields: [a], estimate: {constant: 1}, reservationTtl: soon}")).contains("reservationTtl")
    );
}

#[test]
fn leased_policies_pass_cel_and_their_mistakes_are_caught() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/leasing");
    for loaded in sluice::policy::load_paths(&[dir]).expect("examples load") {
        if let Err(e) = validate_cel(&loaded.policy) {
            panic!("{}: {e:?}", loaded.file.display());
        }
    }
    let rule = |consistency: &str| {
        format!(
            "  rules:\n  - name: t\n    algorithm: fixedWindow\n    limit: {{requests: 1000, per: 1m}}\n    consistency: {consistency}\n"
        )
    };
    assert_eq!(cel_errors(&rule("{mode: leased, maxOvershoot: '2%'}")), "");
    assert_eq!(cel_errors(&rule("{mode: exact}")), "");
    assert!(cel_errors(&rule("{mode: leased}")).contains("leased needs maxOvershoot"));
    assert!(cel_errors(&rule("{mode: exact, maxOvershoot: '5'}")).contains("apply to consistency: leased only"));
    assert!(cel_errors(&rule("{mode: leased, maxOvershoot: '2%', maxStaleness: soon}")).contains("maxStaleness"));
}

/// `spec.egress`: the example passes, a policy of egress alone needs no rules, and each of its
/// rules catches its mistake with the message compile gives.
#[test]
fn egress_passes_cel_and_its_mistakes_are_caught() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/egress");
    for loaded in sluice::policy::load_paths(&[dir]).expect("examples load") {
        if let Err(e) = validate_cel(&loaded.policy) {
            panic!("{}: {e:?}", loaded.file.display());
        }
        sluice::policy::validate(&loaded.policy).expect("the example compiles");
    }
    let entry = |name: &str, port: u16, extra: &str| {
        format!(
            "  - {{name: {name}, destination: \"https://bank.example.com\", listenPort: {port}, limit: {{requests: 5, per: 1s, maxDelay: 1s{extra}}}}}\n"
        )
    };
    assert_eq!(cel_errors(&format!("  egress:\n{}", entry("bank", 15100, ""))), "");
    let cases = [
        ("egress names must be unique", format!("  egress:\n{}{}", entry("bank", 15100, ""), entry("bank", 15101, ""))),
        ("egress listen ports must be unique", format!("  egress:\n{}{}", entry("a", 15100, ""), entry("b", 15100, ""))),
        ("limit.maxDelay (the longest a request waits for its slot) is required",
            "  egress:\n  - {name: b, destination: \"http://b\", listenPort: 15100, limit: {requests: 5, per: 1s}}\n".into()),
        ("remove limit.burst", format!("  egress:\n{}", entry("bank", 15100, ", burst: 3"))),
        ("destination must be an http:// or https:// URL",
            "  egress:\n  - {name: b, destination: \"ftp://b\", listenPort: 15100, limit: {requests: 5, per: 1s, maxDelay: 1s}}\n".into()),
        ("caBundle verifies an https:// destination",
            "  egress:\n  - {name: b, destination: \"http://b\", listenPort: 15100, caBundle: x, limit: {requests: 5, per: 1s, maxDelay: 1s}}\n".into()),
    ];
    for (message, spec) in cases {
        assert!(cel_errors(&spec).contains(message), "{message}: {}", cel_errors(&spec));
    }
}

/// `deferIfLimited`: a writing rule passes; a concurrency, response-cost or shadow rule is caught
/// by the rule meant for it, as the webhook's compile catches it.
#[test]
fn deferring_rules_pass_cel_and_their_mistakes_are_caught() {
    let rule = |algorithm: &str, extra: &str| {
        format!(
            "  rules:\n  - name: w\n    algorithm: {algorithm}\n    limit: {{requests: 10, per: 1s}}\n    deferIfLimited: {{maxQueued: 50}}\n{extra}"
        )
    };
    assert_eq!(cel_errors(&rule("gcra", "    match: {methods: [post, GET]}\n")), "");
    assert_eq!(cel_errors(&rule("fixedWindow", "")), "");
    assert!(cel_errors(&rule("concurrency", "")).contains("a concurrency slot ends with a response"));
    assert!(cel_errors(&rule("gcra", "    mode: shadow\n")).contains("a shadow rule never refuses"));
    // Methods are checked by the webhook alone: a case-insensitive test of each would cost CEL
    // more than the API server allows for strings of unbounded length.
    assert_eq!(cel_errors(&rule("gcra", "    match: {methods: [GET, HEAD]}\n")), "");
    let response_cost = "    responseCost: {fields: [usage.total_tokens], estimate: {constant: 10}}\n";
    assert!(
        cel_errors(&rule("tokenBucket", response_cost)).contains("a cost known after the response"),
        "{}",
        cel_errors(&rule("tokenBucket", response_cost))
    );
}
