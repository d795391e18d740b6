use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use super::crd::MAX_RULES;
use super::*;
use crate::request::names::{canonical_header_name, same_header_name};

fn policy(yaml: &str) -> RateLimitPolicy {
    serde_yaml::from_str(yaml).expect("test policy parses")
}

/// A policy in `ns` named `name` with the given rules (YAML list, indented by 2).
fn with_rules(ns: &str, name: &str, rules: &str) -> RateLimitPolicy {
    policy(&format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  rules:\n{rules}"
    ))
}

fn simple(ns: &str, name: &str, requests: u64) -> RateLimitPolicy {
    with_rules(ns, name, &format!("  - {{name: r, algorithm: gcra, limit: {{requests: {requests}, per: 1s}}}}\n"))
}

fn paths(errs: &ValidationErrors) -> Vec<&str> {
    errs.iter().map(|e| e.path.as_str()).collect()
}

// ---------- validation ----------

#[test]
fn validation_reports_every_problem_with_its_path() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: Bad_Name
    match:
      methods: ["GE T"]
      paths: [{exact: /a, prefix: /b}, {prefix: orders}, {regex: "("}]
      hosts: ["a.*.com"]
      headers: [{name: "X Bad", exact: v}, {name: x-ok}]
    key: [{header: "bad header"}, {clientIP: true, path: true}, {literal: x, missing: skip}, {method: false}]
    algorithm: fixedWindow
    limit: {requests: 10, per: 1x, burst: 5}
  - name: second
    algorithm: tokenBucket
    limit: {requests: 0, per: 1s}
  - name: second
    algorithm: slidingWindowLog
    limit: {requests: 10, per: 1s, burst: 3, maxDelay: 1s}
    cost: 11
"#,
    );
    let errs = validate(&p).unwrap_err();
    let got = paths(&errs);
    for want in [
        "spec.rules[0].name",
        "spec.rules[0].match.methods[0]",
        "spec.rules[0].match.paths[0]",
        "spec.rules[0].match.paths[1].prefix",
        "spec.rules[0].match.paths[2].regex",
        "spec.rules[0].match.hosts[0]",
        "spec.rules[0].match.headers[0].name",
        "spec.rules[0].match.headers[1]",
        "spec.rules[0].key[0].header",
        "spec.rules[0].key[1]",
        "spec.rules[0].key[2].missing",
        "spec.rules[0].key[3].method",
        "spec.rules[0].limit.per",
        "spec.rules[1].limit.requests",
        "spec.rules[2].name",
        "spec.rules[2].limit.burst",
        "spec.rules[2].limit.maxDelay",
        "spec.rules[2].cost",
    ] {
        assert!(got.contains(&want), "missing {want} in {errs}");
    }
    let text = errs.to_string();
    assert!(text.contains(r#"spec.rules[0].limit.per: invalid duration "1x": unknown unit "x""#), "{text}");
    assert!(text.contains(r#"duplicate rule name "second" (also spec.rules[1])"#), "{text}");
}

#[test]
fn limit_errors_map_to_fields() {
    let cases = [
        ("{requests: 10, per: 500us}", "spec.rules[0].limit.per"),
        ("{requests: 10, per: 1500us}", "spec.rules[0].limit.per"),
        ("{requests: 10, per: 1s, burst: 0}", "spec.rules[0].limit.burst"),
        ("{requests: 5000000, per: 1s}", "spec.rules[0].limit.requests"),
        ("{requests: 10, per: 400d}", "spec.rules[0].limit.per"),
    ];
    for (limit, path) in cases {
        let p = with_rules("ns", "p", &format!("  - {{name: r, algorithm: gcra, limit: {limit}}}\n"));
        let errs = validate(&p).unwrap_err();
        assert_eq!(paths(&errs), vec![path], "{limit}: {errs}");
    }
}

#[test]
fn selector_and_metadata_are_checked() {
    let p = policy(
        r#"apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {namespace: ns}
spec:
  selector:
    matchExpressions:
      - {key: app, operator: Near, values: [x]}
      - {key: tier, operator: In}
      - {key: env, operator: Exists, values: [x]}
  rules: []
"#,
    );
    let errs = validate(&p).unwrap_err();
    assert_eq!(
        paths(&errs),
        vec![
            "metadata.name",
            "spec.selector.matchExpressions[0].operator",
            "spec.selector.matchExpressions[1].values",
            "spec.selector.matchExpressions[2].values",
            "spec.rules",
        ]
    );
}

#[test]
fn valid_policy_passes_and_warnings_flag_risks() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: by-path
    key: [{path: true}, {header: X-Key, missing: skip}]
    algorithm: slidingWindowLog
    limit: {requests: 500, per: 1h}
"#,
    );
    validate(&p).unwrap();
    let w = warnings(&p).join("\n");
    assert!(w.contains("key[0]") && w.contains("every distinct path"), "{w}");
    assert!(w.contains("key[1]") && w.contains("x-key") || w.contains("X-Key"), "{w}");
    assert!(w.contains("leave the header out"), "{w}");
    assert!(w.contains("slidingWindowLog"), "{w}");
    assert!(warnings(&simple("ns", "p", 5)).is_empty());
}

// ---------- budgets ----------

/// `n` rules named r0…, each `{algorithm: gcra, limit: {requests: 1, per: 1s}}` plus `extra`.
fn rules(n: usize, extra: impl Fn(usize) -> String) -> String {
    (0..n)
        .map(|i| format!("  - {{name: r{i}, algorithm: gcra, limit: {{requests: 1, per: 1s}}{}}}\n", extra(i)))
        .collect()
}

fn messages(p: &RateLimitPolicy) -> Vec<String> {
    validate(p).err().map(|e| e.iter().map(ToString::to_string).collect()).unwrap_or_default()
}

#[test]
fn sliding_window_log_is_capped_at_max_log_requests() {
    use crate::algorithm::MAX_LOG_REQUESTS;
    let log = |requests: u64, extra: &str| {
        with_rules(
            "ns",
            "p",
            &format!(
                "{}  - {{name: log, algorithm: slidingWindowLog, limit: {{requests: {requests}, per: 1m{extra}}}}}\n",
                rules(2, |_| String::new())
            ),
        )
    };
    assert_eq!(messages(&log(MAX_LOG_REQUESTS, "")), Vec::<String>::new());
    assert_eq!(
        messages(&log(MAX_LOG_REQUESTS + 1, "")),
        [
            "spec.rules[2].limit.requests: slidingWindowLog allows at most 1000 requests per window; use slidingWindowCounter for larger limits"
        ]
    );
    // burst is reported too, not hidden behind the cap.
    let got = messages(&log(5000, ", burst: 5"));
    assert!(got[0].starts_with("spec.rules[2].limit.burst: burst is only used"), "{got:?}");
    assert!(got[1].starts_with("spec.rules[2].limit.requests: slidingWindowLog allows at most 1000"), "{got:?}");
    // The alternative has no such cap, nor do the other algorithms.
    for algorithm in ["slidingWindowCounter", "fixedWindow", "tokenBucket"] {
        let p = with_rules(
            "ns",
            "p",
            &format!("  - {{name: r, algorithm: {algorithm}, limit: {{requests: 1000000, per: 1h}}}}\n"),
        );
        assert_eq!(messages(&p), Vec::<String>::new(), "{algorithm}");
    }
}

#[test]
fn rules_are_capped_at_max_rules() {
    assert_eq!(messages(&with_rules("ns", "p", &rules(MAX_RULES, |_| String::new()))), Vec::<String>::new());
    assert_eq!(
        messages(&with_rules("ns", "p", &rules(MAX_RULES + 1, |_| String::new()))),
        ["spec.rules: at most 64 rules, got 65"]
    );
}

#[test]
fn regexes_are_capped_at_max_regexes_per_policy() {
    // 32 path regexes in rule 0, 32 header regexes in rule 1: 64, the budget.
    let paths = format!(", match: {{paths: [{}]}}", vec![r#"{regex: "/a[0-9]+"}"#; 32].join(", "));
    let headers = format!(", match: {{headers: [{}]}}", vec![r#"{name: x, regex: "a[0-9]+"}"#; 32].join(", "));
    let policy = |extra_rules: usize| {
        with_rules(
            "ns",
            "p",
            &rules(2 + extra_rules, |i| match i {
                0 => paths.clone(),
                1 => headers.clone(),
                _ => r#", match: {paths: [{prefix: /b}, {regex: "/b[0-9]+"}]}"#.into(),
            }),
        )
    };
    assert_eq!(messages(&policy(0)), Vec::<String>::new());
    assert_eq!(
        messages(&policy(2)),
        [
            "spec.rules: at most 64 regexes per policy (match.paths, match.headers and match.descriptor of all rules and priorities together), got 66 (the first over the budget: spec.rules[2].match.paths[1].regex)"
        ]
    );
}

#[test]
fn compiled_regex_size_is_capped_per_policy() {
    use super::crd::{MAX_REGEX_BYTES, MAX_REGEX_BYTES_PER_POLICY};
    // A large regex (the Unicode class \w is big), and how many of them fit in the budget.
    let big = r"\w{4}";
    let size = super::validate::compile_regex(big, false).expect("compiles").memory_usage();
    assert!(size <= MAX_REGEX_BYTES && size > MAX_REGEX_BYTES_PER_POLICY / 8, "{size}");
    let fit = MAX_REGEX_BYTES_PER_POLICY / size;
    let policy = |n: usize| {
        let headers = vec![format!(r#"{{name: x, regex: "{}"}}"#, big.replace('\\', "\\\\")); n].join(", ");
        with_rules(
            "ns",
            "p",
            &format!(
                "  - {{name: r, algorithm: gcra, limit: {{requests: 1, per: 1s}}, match: {{headers: [{headers}]}}}}\n"
            ),
        )
    };
    assert_eq!(messages(&policy(fit)), Vec::<String>::new());
    let errs = validate(&policy(fit + 1)).unwrap_err();
    assert_eq!(paths(&errs), [format!("spec.rules[0].match.headers[{fit}].regex")], "{errs}");
    let text = errs.to_string();
    assert!(
        text.contains(&format!(
            "the policy's regexes take {} bytes compiled, over the budget of 1 MiB (1048576 bytes) per policy; this one ({size} bytes) is the first over it",
            size * (fit + 1)
        )),
        "{text}"
    );
    // The same regexes spread over rules and paths count together.
    let spread = with_rules(
        "ns",
        "p",
        &rules(fit + 1, |_| format!(r#", match: {{paths: [{{regex: "/{}"}}]}}"#, big.replace('\\', "\\\\"))),
    );
    assert_eq!(paths(&validate(&spread).unwrap_err()), [format!("spec.rules[{fit}].match.paths[0].regex")]);
    // One regex over the per-regex limit is refused on its own.
    let huge = with_rules(
        "ns",
        "p",
        r#"  - {name: r, algorithm: gcra, limit: {requests: 1, per: 1s}, match: {paths: [{regex: "\\w{64}"}]}}
"#,
    );
    assert_eq!(
        messages(&huge),
        [
            r#"spec.rules[0].match.paths[0].regex: regex "\\w{64}" is too complex: it compiles to more than 256 KiB (262144 bytes)"#
        ]
    );
}

/// The budgets appear as numbers in the CRD's schema, CEL and `kubectl explain` text and in
/// docs/policy.md; they must be the constants'.
#[test]
fn budget_numbers_in_schema_and_docs_are_the_constants() {
    use super::crd::{MAX_REGEX_BYTES, MAX_REGEX_BYTES_PER_POLICY, MAX_REGEXES_PER_POLICY};
    use super::validate::human_bytes;
    use crate::algorithm::MAX_LOG_REQUESTS;
    let crd = serde_json::to_value(<RateLimitPolicy as kube::CustomResourceExt>::crd()).expect("crd json");
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(spec["properties"]["rules"]["maxItems"], MAX_RULES);
    let yaml = crd_yaml();
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/policy.md")).expect("docs");
    let mib = human_bytes(MAX_REGEX_BYTES_PER_POLICY);
    let kib = human_bytes(MAX_REGEX_BYTES);
    let mib = mib.split(" (").next().unwrap_or_default();
    let kib = kib.split(" (").next().unwrap_or_default();
    for needle in [
        format!("self.limit.requests <= {MAX_LOG_REQUESTS}"),
        format!("at most {MAX_LOG_REQUESTS} requests per window"),
        format!("<= {MAX_REGEXES_PER_POLICY}"),
        format!("at most {MAX_RULES}; names unique"),
        format!("at most {MAX_REGEXES_PER_POLICY} regexes (match.paths, match.headers and match.descriptor of all"),
        format!("most {mib} in total and {kib} each"),
    ] {
        assert!(yaml.contains(&needle), "CRD lacks {needle:?}");
    }
    for needle in [
        format!("{MAX_RULES} rules"),
        format!("{MAX_REGEXES_PER_POLICY} regexes"),
        format!("{mib} of compiled regex"),
        format!("{kib} each"),
        format!("{MAX_LOG_REQUESTS} requests per window"),
    ] {
        assert!(docs.contains(&needle), "docs/policy.md lacks {needle:?}");
    }
}

// ---------- loading ----------

const GOOD: &str = "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: a}\nspec:\n  rules:\n  - {name: r, algorithm: gcra, limit: {requests: 1, per: 1s}}\n";

#[test]
fn load_names_file_document_and_field() {
    let text = format!(
        "{GOOD}---\n{}---\n{}---\n{}---\napiVersion: v1\nkind: ConfigMap\n",
        GOOD.replace("name: a", "name: b").replace("requests: 1,", "requests: ten,"),
        GOOD.replace("name: a", "name: c").replace("per: 1s", "per: 1x"),
        GOOD.replace("name: a", "name: d").replace("requests: 1,", "requests: 1, brust: 3,"),
    );
    let errs = load_str(&text, Path::new("p.yaml")).unwrap_err().to_string();
    let lines: Vec<&str> = errs.lines().collect();
    assert_eq!(lines.len(), 5, "{errs}");
    assert_eq!(
        lines[0],
        r#"p.yaml: document 2: spec.rules[0].limit.requests: invalid type: string "ten", expected a whole number"#
    );
    assert!(
        lines[1].starts_with("p.yaml: document 3: policy default/c: spec.rules[0].limit.per: invalid duration"),
        "{}",
        lines[1]
    );
    assert_eq!(
        lines[2],
        "p.yaml: document 4: spec.rules[0].limit.brust: unknown field `brust` (did you mean `burst`?)"
    );
    assert_eq!(lines[3], r#"p.yaml: document 5: apiVersion: expected sluice.dev/v1alpha1, got "v1""#);
    assert_eq!(lines[4], r#"p.yaml: document 5: kind: expected RateLimitPolicy, got "ConfigMap""#);
}

/// The first error of loading `text` (one policy document).
fn load_error(text: &str) -> String {
    load_str(text, Path::new("p.yaml")).unwrap_err().to_string()
}

#[test]
fn a_misspelt_required_field_is_named_as_unknown_not_as_missing() {
    let err = load_error(&GOOD.replace("algorithm: gcra", "algoritm: gcra"));
    assert_eq!(err, "p.yaml: document 1: spec.rules[0].algoritm: unknown field `algoritm` (did you mean `algorithm`?)");
    let err = load_error(&GOOD.replace("rules:", "rulez:"));
    assert_eq!(err, "p.yaml: document 1: spec.rulez: unknown field `rulez` (did you mean `rules`?)");
}

#[test]
fn unknown_fields_are_found_in_lists_and_nested_mappings() {
    let text = GOOD.replace("limit:", "match: {paths: [{prefix: /a, exakt: /b}]}, limit:");
    let err = load_error(&text);
    assert_eq!(
        err,
        "p.yaml: document 1: spec.rules[0].match.paths[0].exakt: unknown field `exakt` (did you mean `exact`?)"
    );
}

#[test]
fn type_errors_speak_yaml_not_rust() {
    let err = load_error(&GOOD.replace("limit:", "match: {paths: [/orders]}, limit:"));
    assert!(!err.contains("struct") && !err.contains("PathMatch"), "{err}");
    assert!(
        err.contains("spec.rules[0].match.paths[0]: invalid type: string \"/orders\", expected a mapping with fields "),
        "{err}"
    );
    assert!(err.contains("prefix"), "{err}");

    let err = load_error(&GOOD.replace("algorithm: gcra", "algorithm: gcra, mode: true"));
    assert_eq!(
        err,
        "p.yaml: document 1: spec.rules[0].mode: invalid type: boolean `true`, expected one of `enforce`, `shadow`"
    );
    let err = load_error(&GOOD.replace("requests: 1,", "requests: -1,"));
    assert!(
        err.ends_with("spec.rules[0].limit.requests: invalid value: integer `-1`, expected a whole number"),
        "{err}"
    );

    let err = load_error(&GOOD.replace("per: 1s", "per: 60"));
    assert_eq!(
        err,
        "p.yaml: document 1: spec.rules[0].limit.per: invalid type: integer `60`, expected a string: a duration needs its unit, such as `60s`, `1m` or `500ms`"
    );
}

#[test]
fn load_defaults_namespace_and_reads_directories_sorted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("b.yaml"), GOOD.replace("name: a", "name: b")).unwrap();
    std::fs::write(dir.path().join("a.yml"), format!("---\n{GOOD}")).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not yaml: [").unwrap();
    let loaded = load_paths(&[dir.path()]).unwrap();
    let names: Vec<String> = loaded.iter().map(|l| l.policy.qualified_name()).collect();
    assert_eq!(names, vec!["default/a", "default/b"]);
    assert!(loaded[0].file.ends_with("a.yml"));
}

#[test]
fn load_duplicate_names_both_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("one.yaml"), GOOD).unwrap();
    std::fs::write(dir.path().join("two.yaml"), format!("{GOOD}---\n{}", GOOD.replace("name: a", "name: z"))).unwrap();
    let err = load_paths(&[dir.path()]).unwrap_err().to_string();
    assert!(err.contains("policy default/a is defined twice"), "{err}");
    assert!(err.contains("one.yaml document 1") && err.contains("two.yaml document 1"), "{err}");
}

#[test]
fn load_reports_yaml_syntax_and_missing_file() {
    let err = load_str("spec: [unclosed", Path::new("x.yaml")).unwrap_err().to_string();
    assert!(err.starts_with("x.yaml: document 1: "), "{err}");
    let err = load_paths(&["/nonexistent/policies.yaml"]).unwrap_err().to_string();
    assert!(err.starts_with("/nonexistent/policies.yaml: "), "{err}");
}

// ---------- compile ----------

#[test]
fn compile_rejects_invalid_and_keeps_valid() {
    let bad = with_rules("ns", "bad", "  - {name: r, algorithm: gcra, limit: {requests: 1, per: nope}}\n");
    let c = compile(vec![simple("ns", "good", 5), bad]);
    assert_eq!(c.rejected.len(), 1);
    assert_eq!(c.rejected[0].policy, "ns/bad");
    assert_eq!(c.rejected[0].errors.errors[0].path, "spec.rules[0].limit.per");
    assert_eq!(c.snapshot.rule_count(), 1);
}

#[test]
fn version_is_order_independent_and_tracks_numbers_but_rule_id_does_not() {
    let a = compile(vec![simple("ns", "a", 5), simple("ns", "b", 5), simple("other", "a", 5)]).snapshot;
    let b = compile(vec![simple("other", "a", 5), simple("ns", "b", 5), simple("ns", "a", 5)]).snapshot;
    assert_eq!(a.version(), b.version());
    assert_eq!(a.version().len(), 16);
    let c = compile(vec![simple("ns", "a", 6), simple("ns", "b", 5), simple("other", "a", 5)]).snapshot;
    assert_ne!(a.version(), c.version());
    let id = |s: &Snapshot| s.namespace_policies("ns")[0].rules()[0].id();
    assert_eq!(id(&a), id(&c));
    assert_eq!(id(&a), rule_id("ns/a/r"));
    assert_eq!(a.namespace_policies("ns")[0].rules()[0].identity(), "ns/a/r");
    assert_ne!(rule_id("ns/a/r"), rule_id("ns/b/r"));
}

#[test]
fn snapshot_header_names() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: r
    match: {headers: [{name: X-Tenant, present: true}]}
    key: [{header: X-API-Key}, {clientIP: true}]
    algorithm: tokenBucket
    limit: {requests: 10, per: 1s, burst: 5}
    mode: shadow
    onStoreFailure: deny
"#,
    );
    let s = compile(vec![p]).snapshot;
    assert_eq!(s.header_names(), ["x-api-key", "x-tenant"]);
}

// ---------- matching ----------

struct Req {
    labels: BTreeMap<String, String>,
    headers: BTreeMap<String, String>,
}

impl Req {
    fn new(labels: &[(&str, &str)], headers: &[(&str, &str)]) -> Req {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Req { labels: map(labels), headers: map(headers) }
    }
    fn view<'a>(&'a self, ns: &'a str, method: &'a str, path: &'a str) -> RequestView<'a> {
        RequestView {
            namespace: ns,
            labels: &self.labels,
            method,
            path,
            headers: &self.headers,
            ..RequestView::new(path)
        }
    }
}

fn matched_rules(s: &Snapshot, req: &RequestView) -> Vec<String> {
    let mut out = Vec::new();
    s.resolve(req, &mut out);
    out.iter().map(|m| m.rule.identity().to_string()).collect()
}

fn one_rule(m: &str) -> Snapshot {
    let p = with_rules(
        "ns",
        "p",
        &format!("  - {{name: r, match: {m}, algorithm: gcra, limit: {{requests: 5, per: 1s}}}}\n"),
    );
    let c = compile(vec![p]);
    assert!(c.rejected.is_empty(), "{:?}", c.rejected);
    c.snapshot
}

fn hits(s: &Snapshot, req: &RequestView) -> bool {
    !matched_rules(s, req).is_empty()
}

#[test]
fn prefix_matches_whole_segments() {
    let s = one_rule("{paths: [{prefix: /orders/}]}");
    let r = Req::new(&[], &[]);
    for (path, want) in [
        ("/orders", true),
        ("/orders/1", true),
        ("/orders?x=1", true),
        ("/orders/", true),
        ("/ordersX", false),
        ("/order", false),
        ("/", false),
    ] {
        assert_eq!(hits(&s, &r.view("ns", "GET", path)), want, "{path}");
    }
    let root = one_rule("{paths: [{prefix: /}]}");
    assert!(hits(&root, &r.view("ns", "GET", "/anything/at/all")));
}

#[test]
fn exact_regex_methods_hosts() {
    let r = Req::new(&[], &[]);
    let s = one_rule("{paths: [{exact: /login}]}");
    assert!(hits(&s, &r.view("ns", "GET", "/login?next=/")));
    assert!(!hits(&s, &r.view("ns", "GET", "/login/x")));

    let s = one_rule(r#"{paths: [{regex: "/users/[0-9]+"}]}"#);
    assert!(hits(&s, &r.view("ns", "GET", "/users/42")));
    assert!(!hits(&s, &r.view("ns", "GET", "/users/42/orders")), "regex is anchored");

    let s = one_rule("{methods: [post, PUT]}");
    assert!(hits(&s, &r.view("ns", "POST", "/")));
    assert!(hits(&s, &r.view("ns", "put", "/")));
    assert!(!hits(&s, &r.view("ns", "GET", "/")));

    let s = one_rule(r#"{hosts: ["*.Example.com", api.test]}"#);
    let host = |h: &'static str| RequestView { host: Some(h), ..RequestView::new("/") };
    let in_ns = |v: RequestView<'static>| RequestView { namespace: "ns", ..v };
    assert!(hits(&s, &in_ns(host("a.example.COM:8443"))));
    assert!(hits(&s, &in_ns(host("a.b.example.com"))));
    assert!(!hits(&s, &in_ns(host("example.com"))));
    assert!(!hits(&s, &in_ns(host("badexample.com"))));
    assert!(hits(&s, &in_ns(host("API.test."))));
    assert!(!hits(&s, &in_ns(RequestView::new("/"))), "no host never matches a host list");
}

#[test]
fn ignore_case_is_a_rules_choice_and_keys_the_path_lowercased() {
    let r = Req::new(&[], &[]);
    let sensitive = one_rule("{paths: [{prefix: /orders}]}");
    assert!(!hits(&sensitive, &r.view("ns", "GET", "/Orders/1")), "case is kept by default");
    for m in ["{paths: [{prefix: /Orders/, ignoreCase: true}]}", "{paths: [{exact: /ORDERS/1, ignoreCase: true}]}"] {
        let s = one_rule(m);
        for path in ["/orders/1", "/Orders/1", "/ORDERS/1", "/oRdErS%2F1"] {
            assert!(hits(&s, &r.view("ns", "GET", path)), "{m}: {path}");
        }
        assert!(!hits(&s, &r.view("ns", "GET", "/ordersX/1")), "{m}");
    }
    let s = one_rule(r#"{paths: [{regex: "/orders/[a-z]+", ignoreCase: true}]}"#);
    assert!(hits(&s, &r.view("ns", "GET", "/ORDERS/ABC")));

    let p = with_rules(
        "ns",
        "p",
        r#"  - name: r
    match: {paths: [{prefix: /orders, ignoreCase: true}]}
    key: [{path: true}]
    algorithm: gcra
    limit: {requests: 5, per: 1s}
"#,
    );
    let s = compile(vec![p]).snapshot;
    let mut out = Vec::new();
    s.resolve(&r.view("ns", "GET", "/Orders/A1"), &mut out);
    assert_eq!(out[0].key, encode_key(["/orders/a1"]), "a new spelling is no new counter");
    assert_eq!(out[0].rule.key_description(), "path (lowercased)");
}

#[test]
fn path_patterns_no_normalized_path_reads_are_flagged() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: r
    match: {paths: [{prefix: /orders;v=1}, {exact: /files./a}, {prefix: /ok/}, {exact: /Fine}]}
    algorithm: gcra
    limit: {requests: 5, per: 1s}
"#,
    );
    let warned = warnings(&p);
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(warned[0].starts_with("spec.rules[0].match.paths[0].prefix: ") && warned[0].contains(r#"reads "/orders""#));
    assert!(warned[1].starts_with("spec.rules[0].match.paths[1].exact: "), "{warned:?}");
}

#[test]
fn header_names_are_canonical_underscore_or_dash() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: r
    match: {headers: [{name: X_Tenant, present: true}]}
    key: [{header: X-API_Key}]
    algorithm: gcra
    limit: {requests: 5, per: 1s}
"#,
    );
    let s = compile(vec![p]).snapshot;
    assert_eq!(s.header_names(), ["x-api-key", "x-tenant"], "what the sidecar sends, under these names");
    let r = Req::new(&[], &[("x-tenant", "t"), ("x-api-key", "k1")]);
    let mut out = Vec::new();
    s.resolve(&r.view("ns", "GET", "/"), &mut out);
    assert_eq!(out[0].key, encode_key(["k1"]));
    assert!(same_header_name("X_API-Key", "x-api_key"));
    assert!(!same_header_name("x-api-key", "x-api-keys"));
    assert_eq!(canonical_header_name("X_API-Key"), "x-api-key");
}

#[test]
fn header_matchers() {
    let s = one_rule(
        r#"{headers: [{name: X-Tenant, prefix: acme}, {name: X-Debug, present: false}, {name: X-Plan, regex: "gold|silver"}]}"#,
    );
    let check = |h: &[(&str, &str)]| {
        let r = Req::new(&[], h);
        hits(&s, &r.view("ns", "GET", "/"))
    };
    assert!(check(&[("x-tenant", "acme-1"), ("x-plan", "gold")]));
    assert!(!check(&[("x-tenant", "acme-1"), ("x-plan", "golden")]));
    assert!(!check(&[("x-tenant", "other"), ("x-plan", "gold")]));
    assert!(!check(&[("x-tenant", "acme"), ("x-plan", "gold"), ("x-debug", "1")]));
    let s = one_rule("{headers: [{name: X-Env, exact: prod}]}");
    let r = Req::new(&[], &[("x-env", "Prod")]);
    assert!(!hits(&s, &r.view("ns", "GET", "/")), "values are case-sensitive");
}

#[test]
fn selector_expressions_and_namespace() {
    let p = policy(
        r#"apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  selector:
    matchLabels: {app: orders}
    matchExpressions:
      - {key: tier, operator: In, values: [web, api]}
      - {key: env, operator: NotIn, values: [dev]}
      - {key: team, operator: Exists}
      - {key: canary, operator: DoesNotExist}
  rules:
    - {name: r, algorithm: gcra, limit: {requests: 5, per: 1s}}
"#,
    );
    let s = compile(vec![p]).snapshot;
    let base = [("app", "orders"), ("tier", "web"), ("team", "x")];
    let check = |extra: &[(&str, &str)], remove: &str| {
        let labels: Vec<(&str, &str)> = base.iter().chain(extra).copied().filter(|(k, _)| *k != remove).collect();
        let r = Req::new(&labels, &[]);
        hits(&s, &r.view("ns", "GET", "/"))
    };
    assert!(check(&[], ""));
    assert!(check(&[("env", "prod")], ""));
    assert!(!check(&[("env", "dev")], ""));
    assert!(!check(&[("canary", "1")], ""));
    assert!(!check(&[], "team"));
    assert!(!check(&[], "tier"));
    assert!(!check(&[], "app"));
    let r = Req::new(&base, &[]);
    assert!(!hits(&s, &r.view("other", "GET", "/")), "other namespace");
}

#[test]
fn resolve_order_cost_and_keys() {
    let a = with_rules(
        "ns",
        "b-second",
        r#"  - {name: z, algorithm: gcra, limit: {requests: 5, per: 1s}, cost: 3}
  - name: keyed
    key: [{method: true}, {host: true}, {path: true}, {namespace: true}, {literal: "v|1"}, {clientIP: true}]
    algorithm: gcra
    limit: {requests: 5, per: 1s}
"#,
    );
    let b = simple("ns", "a-first", 5);
    let s = compile(vec![a, b]).snapshot;
    let r = Req::new(&[], &[]);
    let req = RequestView {
        host: Some("API.Example.com:443"),
        client_ip: Some("::ffff:10.1.2.3".parse::<IpAddr>().unwrap()),
        cost: 2,
        ..r.view("ns", "post", "/x/y?q=1")
    };
    let mut out = Vec::new();
    s.resolve(&req, &mut out);
    let ids: Vec<&str> = out.iter().map(|m| m.rule.identity()).collect();
    assert_eq!(ids, ["ns/a-first/r", "ns/b-second/z", "ns/b-second/keyed"]);
    assert_eq!(out[1].cost, 6);
    assert_eq!(out[0].key, "");
    assert_eq!(out[2].key, encode_key(["POST", "api.example.com", "/x/y", "ns", "v|1", "10.1.2.3"]));
    let check = out[2].rule.check(out[2].key.as_bytes(), out[2].cost);
    assert_eq!(check.key, out[2].key.as_bytes());
    assert_eq!(check.rule, rule_id("ns/b-second/keyed"));
    assert!(check.enforce);
}

#[test]
fn key_encoding_is_unambiguous() {
    assert_ne!(encode_key(["a|b", "c"]), encode_key(["a", "b|c"]));
    assert_ne!(encode_key(["a:b", "c"]), encode_key(["a", "b:c"]));
    assert_ne!(encode_key(["1:a"]), encode_key(["", "a"]));
    assert_eq!(encode_key(["a|b", "c"]), "3:a|b1:c");
}

#[test]
fn missing_header_share_or_skip() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - {name: share, key: [{header: X-Key}], algorithm: gcra, limit: {requests: 5, per: 1s}}
  - {name: skip, key: [{header: X-Key, missing: skip}], algorithm: gcra, limit: {requests: 5, per: 1s}}
  - {name: ip-skip, key: [{clientIP: true, missing: skip}], algorithm: gcra, limit: {requests: 5, per: 1s}}
  - {name: ip-share, key: [{clientIP: true}], algorithm: gcra, limit: {requests: 5, per: 1s}}
"#,
    );
    let s = compile(vec![p]).snapshot;
    let without = Req::new(&[], &[]);
    let mut out = Vec::new();
    s.resolve(&without.view("ns", "GET", "/"), &mut out);
    let got: Vec<(&str, &str)> = out.iter().map(|m| (m.rule.name(), m.key.as_str())).collect();
    assert_eq!(got, [("share", "0:"), ("ip-share", "0:")]);
    let with = Req::new(&[], &[("x-key", "k1")]);
    s.resolve(&with.view("ns", "GET", "/"), &mut out);
    let got: Vec<(&str, &str)> = out.iter().map(|m| (m.rule.name(), m.key.as_str())).collect();
    assert_eq!(got, [("share", "2:k1"), ("skip", "2:k1"), ("ip-share", "0:")]);
}

#[test]
fn cel_duration_pattern_agrees_with_parser() {
    let re = regex::Regex::new(crd::DURATION_PATTERN).unwrap();
    for ok in ["1s", "500ms", "1m30s", "1.5h", "1d", "10us", "0", ".5s"] {
        assert!(re.is_match(ok), "{ok}");
        assert!(crate::duration::parse_duration(ok).is_ok(), "{ok}");
    }
    for bad in ["", "1", "1x", "s", "1.2.3s", "00", "01s0", " 1s"] {
        assert!(!re.is_match(bad), "{bad}");
    }
    let yaml = crd_yaml();
    assert!(yaml.contains(r"self.matches('^(0|(([0-9]+(\\.[0-9]+)?|\\.[0-9]+)(us|µs|ms|s|m|h|d))+)$')"));
}

#[test]
fn snapshot_is_shareable_and_empty_has_a_version() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Snapshot>();
    let empty = Snapshot::default();
    assert_eq!(empty.version().len(), 16);
    assert_eq!(empty.version(), compile(Vec::new()).snapshot.version());
    let mut out = Vec::new();
    empty.resolve(&RequestView::new("/"), &mut out);
    assert!(out.is_empty());
}

// ---------- rate limit descriptors ----------

fn descriptor_snapshot() -> Snapshot {
    let p = with_rules(
        "edge",
        "rls",
        r#"  - name: per-address
    match: {descriptor: [{key: remote_address}]}
    key: [{descriptor: remote_address}]
    algorithm: fixedWindow
    limit: {requests: 10, per: 1s}
  - name: bot
    match: {descriptor: [{key: user_agent, prefix: bot-}]}
    algorithm: fixedWindow
    limit: {requests: 1, per: 1s}
  - name: per-path-default
    match: {descriptor: [{key: generic_key, exact: api}, {key: path, notIn: [/healthz], notPrefix: [/internal/]}]}
    key: [{descriptor: path}]
    algorithm: fixedWindow
    limit: {requests: 5, per: 1s}
  - name: numeric-tenant
    match: {descriptor: [{key: tenant, regex: "[0-9]+"}]}
    key: [{literal: t}, {descriptor: tenant}]
    algorithm: fixedWindow
    limit: {requests: 5, per: 1s}
  - name: http-only
    algorithm: fixedWindow
    limit: {requests: 5, per: 1s}
"#,
    );
    let compiled = compile(vec![p]);
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    compiled.snapshot
}

fn descriptor_matches(s: &Snapshot, entries: &[(&str, &str)]) -> Vec<(String, String)> {
    let descriptor: Vec<(&str, &str)> = entries.to_vec();
    let view = RequestView::descriptor("edge", &descriptor, 1);
    let mut out = Vec::new();
    s.resolve(&view, &mut out);
    out.iter().map(|m| (m.rule.name().to_string(), m.key.clone())).collect()
}

#[test]
fn descriptor_rules_match_entries_in_order_and_key_on_their_values() {
    let s = descriptor_snapshot();
    let named = |v: Vec<(String, String)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(
        descriptor_matches(&s, &[("remote_address", "10.0.0.1")]),
        vec![("per-address".into(), "8:10.0.0.1".into())]
    );
    assert_eq!(named(descriptor_matches(&s, &[("user_agent", "bot-x")])), ["bot"]);
    assert!(descriptor_matches(&s, &[("user_agent", "curl")]).is_empty(), "prefix");
    assert_eq!(
        descriptor_matches(&s, &[("generic_key", "api"), ("path", "/orders")]),
        vec![("per-path-default".into(), "7:/orders".into())]
    );
    assert!(descriptor_matches(&s, &[("generic_key", "api"), ("path", "/healthz")]).is_empty(), "notIn");
    assert!(descriptor_matches(&s, &[("generic_key", "api"), ("path", "/internal/x")]).is_empty(), "notPrefix");
    assert!(descriptor_matches(&s, &[("path", "/orders"), ("generic_key", "api")]).is_empty(), "order counts");
    assert!(descriptor_matches(&s, &[("generic_key", "api")]).is_empty(), "as many entries as the rule");
    assert!(
        descriptor_matches(&s, &[("remote_address", "10.0.0.1"), ("path", "/")]).is_empty(),
        "a longer descriptor is another tree node"
    );
    assert_eq!(descriptor_matches(&s, &[("tenant", "42")]), vec![("numeric-tenant".into(), "1:t2:42".into())]);
    assert!(descriptor_matches(&s, &[("tenant", "42a")]).is_empty(), "regex matches the whole value");
    assert!(descriptor_matches(&s, &[]).is_empty(), "an empty descriptor matches no rule, not even http-only");
}

#[test]
fn descriptor_rules_never_apply_to_http_requests_nor_http_rules_to_descriptors() {
    let s = descriptor_snapshot();
    let http = RequestView { namespace: "edge", ..RequestView::new("/orders") };
    assert_eq!(matched_rules(&s, &http), ["edge/rls/http-only"]);
    assert!(!descriptor_matches(&s, &[("remote_address", "a")]).iter().any(|(n, _)| n == "http-only"));
}

#[test]
fn descriptor_rules_are_validated() {
    let p = with_rules(
        "ns",
        "p",
        r#"  - name: mixed
    match: {methods: [GET], descriptor: [{key: a, exact: x, prefix: y}, {key: "", regex: "("}]}
    key: [{descriptor: b}, {header: x-api-key}]
    algorithm: fixedWindow
    limit: {requests: 10, per: 1s}
  - name: http
    key: [{descriptor: a}]
    algorithm: fixedWindow
    limit: {requests: 10, per: 1s}
"#,
    );
    let errs = validate(&p).unwrap_err();
    let got = paths(&errs);
    for want in [
        "spec.rules[0].match.descriptor",
        "spec.rules[0].match.descriptor[0]",
        "spec.rules[0].match.descriptor[1].key",
        "spec.rules[0].match.descriptor[1].regex",
        "spec.rules[0].key[0].descriptor",
        "spec.rules[0].key[1]",
        "spec.rules[1].key[0].descriptor",
    ] {
        assert!(got.contains(&want), "missing {want} in {got:?}");
    }
}

/// Issue 23, item 3: a key built from long values is held as its 64-byte digest (what the Redis
/// key carried already), so a check of 64 rules x 8 key parts of an 8 KiB header holds 64 x 64
/// bytes of keys while it waits for the store, not 64 x 64 KiB. Equal values, equal keys.
#[test]
fn long_keys_are_held_as_their_digest() {
    let parts: String = (0..8).map(|_| "{header: X-Big}, ").collect();
    let p = with_rules(
        "ns",
        "p",
        &format!(
            "  - name: r\n    key: [{}]\n    algorithm: gcra\n    limit: {{requests: 5, per: 1s}}\n",
            parts.trim_end_matches(", ")
        ),
    );
    let s = compile(vec![p]).snapshot;
    let key_of = |value: &str| {
        let r = Req::new(&[], &[("x-big", value)]);
        let mut out = Vec::new();
        s.resolve(&r.view("ns", "GET", "/"), &mut out);
        out[0].key.clone()
    };
    let big = "v".repeat(8192);
    let key = key_of(&big);
    assert_eq!(key.len(), 64, "{}", &key[..key.len().min(80)]);
    assert_eq!(key, crate::rule::long_key_digest(encode_key(vec![big.as_str(); 8]).as_bytes()));
    assert_eq!(key, key_of(&big), "the same values, the same key");
    assert_ne!(key, key_of(&"w".repeat(8192)));
    assert_eq!(key_of("short"), encode_key(["short"; 8]), "short keys stay as they are");
}

/// Issue 24: a concurrency rule counts requests (cost does not apply) and needs a release
/// signal, which descriptor matches (the rate limit service) never give.
#[test]
fn concurrency_rules_refuse_cost_and_descriptors() {
    let rule = |extra: &str| {
        with_rules(
            "ns",
            "p",
            &format!(
                "  - name: r\n    key: [{{header: X-Tenant}}]\n    algorithm: concurrency\n    limit: {{requests: 20, per: 5m}}\n{extra}"
            ),
        )
    };
    assert!(compile(vec![rule("")]).rejected.is_empty(), "a plain concurrency rule is fine");
    let errors = |p| {
        compile(vec![p])
            .rejected
            .iter()
            .flat_map(|r| r.errors.errors.iter().map(|e| format!("{}: {}", e.path, e.message)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let cost = errors(rule("    cost: 2\n"));
    assert!(cost.contains("spec.rules[0].cost") && cost.contains("cost does not apply"), "{cost}");
    let descriptor = errors(rule("    match: {descriptor: [{key: tenant}]}\n"));
    assert!(descriptor.contains("spec.rules[0].match.descriptor") && descriptor.contains("release"), "{descriptor}");
    let many = errors(with_rules(
        "ns",
        "p",
        "  - name: r\n    algorithm: concurrency\n    limit: {requests: 10001, per: 5m}\n",
    ));
    assert!(many.contains("spec.rules[0].limit.requests") && many.contains("10000"), "{many}");
}

mod overload {
    use super::super::*;
    use crate::overload::Class;

    fn compiled(spec: &str) -> Result<Snapshot, String> {
        let yaml = format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: protect, namespace: shop}}\nspec:\n{spec}"
        );
        let loaded = load_str(&yaml, std::path::Path::new("p.yaml")).map_err(|e| e.to_string())?;
        let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
        match compiled.rejected.first() {
            Some(rejected) => Err(rejected.errors.to_string()),
            None => Ok(compiled.snapshot),
        }
    }

    fn class_of(snapshot: &Snapshot, method: &str, path: &str, headers: &[(&str, &str)]) -> Class {
        let labels: std::collections::BTreeMap<String, String> = [("app".to_string(), "shop".to_string())].into();
        let headers: std::collections::BTreeMap<String, String> =
            headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let view = RequestView {
            namespace: "shop",
            labels: &labels,
            method,
            path,
            host: None,
            client_ip: None,
            headers: &headers,
            cost: 1,
            fields: &crate::request::names::NoEntries,
            descriptor: None,
            egress: None,
            max_wait: None,
        };
        snapshot.classify(&view).0
    }

    const PRIORITIES: &str = "  selector: {matchLabels: {app: shop}}\n  priorities:\n    - {class: critical, match: {methods: [POST], paths: [{prefix: /checkout}]}}\n    - {class: sheddable, match: {paths: [{prefix: /reports}]}}\n    - {class: critical, match: {headers: [{name: X-Tier, exact: gold}]}}\n  overload: {}\n  rules: []\n";

    #[test]
    fn the_first_matching_entry_gives_the_class() {
        let snapshot = compiled(PRIORITIES).unwrap();
        assert_eq!(class_of(&snapshot, "POST", "/checkout/1", &[]), Class::Critical);
        assert_eq!(class_of(&snapshot, "GET", "/checkout/1", &[]), Class::Default, "methods: POST only");
        assert_eq!(class_of(&snapshot, "GET", "//reports/./x", &[]), Class::Sheddable, "normalized path");
        assert_eq!(class_of(&snapshot, "GET", "/reports", &[("x-tier", "gold")]), Class::Sheddable, "first wins");
        assert_eq!(class_of(&snapshot, "GET", "/search", &[("x-tier", "gold")]), Class::Critical);
        assert!(snapshot.header_names().iter().any(|h| h == "x-tier"), "the sidecar must send X-Tier");
        let labels: std::collections::BTreeMap<String, String> = [("app".to_string(), "other".to_string())].into();
        assert!(snapshot.overload_for("shop", &labels).is_none(), "the selector applies");
    }

    #[test]
    fn overload_fields_are_validated_by_name() {
        let err = compiled("  overload: {minLimit: 10, maxLimit: 5, initialLimit: 7}\n  rules: []\n").unwrap_err();
        assert!(err.contains("spec.overload.minLimit") && err.contains("spec.overload.initialLimit"), "{err}");
        let err = compiled("  overload: {criticalWait: soon}\n  rules: []\n").unwrap_err();
        assert!(err.contains("spec.overload.criticalWait"), "{err}");
        let err = compiled("  rules: []\n").unwrap_err();
        assert!(err.contains("at least one rule is required (or spec.overload, or spec.egress)"), "{err}");
        let err = compiled(
            "  priorities: [{class: critical, match: {descriptor: [{key: k}]}}]\n  overload: {}\n  rules: []\n",
        )
        .unwrap_err();
        assert!(err.contains("spec.priorities[0].match.descriptor"), "{err}");
        let err = compiled(
            "  priorities: [{class: critical, match: {paths: [{regex: '('}]}}]\n  overload: {}\n  rules: []\n",
        )
        .unwrap_err();
        assert!(err.contains("spec.priorities[0].match.paths[0]"), "{err}");
    }

    #[test]
    fn a_refusal_is_bounded_and_may_not_set_what_sluice_sets() {
        let rule = |refusal: &str| {
            format!(
                "  rules:\n    - {{name: r, algorithm: gcra, limit: {{requests: 1, per: 1s}}, refusal: {refusal}}}\n"
            )
        };
        assert!(compiled(&rule("{status: 200, headers: {content-type: text/plain}, body: cached}")).is_ok());
        let err = compiled(&rule("{status: 100}")).unwrap_err();
        assert!(err.contains("spec.rules[0].refusal.status"), "{err}");
        let err = compiled(&rule("{headers: {retry-after: '5'}}")).unwrap_err();
        assert!(err.contains("spec.rules[0].refusal.headers") && err.contains("retry-after"), "{err}");
        let err = compiled(&rule("{headers: {Connection: close}}")).unwrap_err();
        assert!(err.contains("Connection"), "{err}");
        let long = "x".repeat(5000);
        let err = compiled(&rule(&format!("{{body: {long}}}"))).unwrap_err();
        assert!(err.contains("spec.rules[0].refusal.body"), "{err}");
        let err = compiled(
            "  rules:\n    - {name: r, algorithm: gcra, limit: {requests: 1, per: 1s}, retryAfterJitter: lots}\n",
        )
        .unwrap_err();
        assert!(err.contains("spec.rules[0].retryAfterJitter"), "{err}");
    }
}

// ---------- responseCost ----------

fn response_cost_rule(algorithm: &str, limit: &str, response_cost: &str) -> RateLimitPolicy {
    with_rules(
        "ai",
        "tokens",
        &format!("  - {{name: t, algorithm: {algorithm}, limit: {limit}, responseCost: {response_cost}}}\n"),
    )
}

#[test]
fn response_cost_mistakes_are_named_with_their_field() {
    let ok = "{fields: [usage.total_tokens], estimate: {requestField: max_tokens, plus: 100, cap: 4000}}";
    assert!(validate(&response_cost_rule("fixedWindow", "{requests: 100000, per: 1m}", ok)).is_ok());
    let cases = [
        ("slidingWindowLog", "{requests: 1000, per: 1m}", "{fields: [a], estimate: {constant: 1}}", "slidingWindowLog"),
        ("concurrency", "{requests: 10, per: 1m}", "{fields: [a], estimate: {constant: 1}}", "concurrency"),
        ("leakyBucket", "{requests: 10, per: 1s, maxDelay: 1s}", "{fields: [a], estimate: {constant: 1}}", "maxDelay"),
        (
            "fixedWindow",
            "{requests: 1000, per: 1m}",
            "{fields: [a], estimate: {constant: 5000}}",
            "could never be admitted",
        ),
        ("fixedWindow", "{requests: 1000, per: 1m}", "{fields: ['a..b'], estimate: {constant: 1}}", "fields[0]"),
        ("fixedWindow", "{requests: 1000, per: 1m}", "{estimate: {constant: 1}}", "needs fields or a header"),
        (
            "fixedWindow",
            "{requests: 1000, per: 1m}",
            "{fields: [a], estimate: {requestField: max_tokens}}",
            "needs a cap",
        ),
        (
            "fixedWindow",
            "{requests: 1000, per: 1m}",
            "{fields: [a], estimate: {constant: 1}, reservationTtl: 2d}",
            "reservationTtl",
        ),
        ("fixedWindow", "{requests: 1000, per: 1m}", "{header: 'bad header', estimate: {constant: 1}}", "header"),
    ];
    for (algorithm, limit, response_cost, named) in cases {
        let found = messages(&response_cost_rule(algorithm, limit, response_cost));
        assert!(found.iter().any(|m| m.contains(named)), "{algorithm} {response_cost}: {found:?}");
    }
}

#[test]
fn a_reserving_rule_reserves_its_estimate_from_the_request_fields() {
    let p = response_cost_rule(
        "fixedWindow",
        "{requests: 100000, per: 1m}",
        "{fields: [usage.total_tokens], estimate: {requestField: max_tokens, plus: 100, cap: 4000}}",
    );
    let compiled = compile(vec![p]);
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    let estimate = |fields: &BTreeMap<String, String>| {
        let view = RequestView { namespace: "ai", fields, ..RequestView::new("/") };
        let mut matched = Vec::new();
        compiled.snapshot.resolve(&view, &mut matched);
        (matched[0].cost, matched[0].rule.limit().reservation_ttl())
    };
    let field = |v: &str| BTreeMap::from([("max_tokens".to_string(), v.to_string())]);
    assert_eq!(estimate(&field("500")), (600, Some(600_000_000)), "max_tokens + plus, reserved for 10m");
    assert_eq!(estimate(&field("9999")).0, 4000, "at most the cap");
    assert_eq!(estimate(&BTreeMap::new()).0, 4000, "no field: the cap");
    assert_eq!(estimate(&field("-3")).0, 4000, "not a count: the cap");
    assert_eq!(compiled.snapshot.estimate_fields("ai"), ["max_tokens"]);
}
